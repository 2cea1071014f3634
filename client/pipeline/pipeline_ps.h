/* pipeline_ps.h - a pipeline stage's variables on the ps tasks (workerd
 * --pipeline_stages with the ps: --pipeline_updates=ps). The placement is
 * the whole model's, as every sync worker computes it (placement.h); a stage
 * owns the pieces that lie in its run of the whole parameter buffer
 * [off, off + n) and pulls and pushes only the ps tasks that hold some of
 * them. A pull takes a shard's whole body (GET /v1/params has no name
 * filter) and copies out the stage's pieces; a push holds the stage's pieces
 * only, so the ps averages each variable over the R replicas that push it.
 *
 * Every ps task must complete each step with the pushes it gets: a ps
 * refuses an empty push, so the chief configures each ps with
 * replicas_to_aggregate = R x the stages that hold variables there
 * (pipe_ps_pushers), and the stages without variables there never push to it.
 * Nothing here exits. */
#ifndef RESTPS_PIPELINE_PS_H
#define RESTPS_PIPELINE_PS_H

#include <stddef.h>
#include <stdint.h>

#include "libps/libps.h"
#include "model/model.h"
#include "shards/shards.h"

typedef struct pipe_ps_shard {
    int ps;              /* the ps task */
    int n_p;             /* this stage's pieces on it, in buffer order */
    int *p;              /* their indices in the placement */
    size_t floats;       /* their floats */
    unsigned char *rx;   /* a pull of the shard's whole body lands here */
    size_t rx_cap;
    float *stage;        /* the stage's gradients on this shard, gathered for a push */
    int64_t step;        /* the shard's global_step at the last pull */
} pipe_ps_shard;

typedef struct pipe_ps {
    ps_client *c;        /* borrowed */
    placement pl;        /* the whole model's */
    size_t off, n;       /* the stage's run of the whole parameter buffer */
    int n_sh;            /* the ps tasks holding some of the stage's pieces */
    pipe_ps_shard *sh;
} pipe_ps;

/* 0, or -1 with err (out of memory). Free with pipe_ps_free (also after a failure). */
int pipe_ps_init(pipe_ps *p, ps_client *c, const model_layout *L, place_policy policy,
                 uint64_t partition_bytes, size_t off, size_t n, char *err, size_t errlen);
void pipe_ps_free(pipe_ps *p);

/* For the chief's configuration: out[i] = R x the number of stages (runs
 * [poff[k], poff[k] + pn[k]) of the buffer) that hold a piece on ps i, or
 * K x R where none does (nobody pushes there; it never steps). */
void pipe_ps_pushers(const placement *pl, const size_t *poff, const size_t *pn, int K, int R, int *out);

/* Pull the stage's pieces into params (the stage's run: params[0] is the
 * whole buffer's off), each shard long-polled until its global_step reaches
 * min_step (< 0: no wait), for at most wait_secs in all; abort (may be NULL)
 * stops the wait. 0 with every shard at exactly min_step (min_step < 0: *step
 * the first shard's, all equal); -1 with err (a shard at another step: it
 * restarted, or was restored from another step's checkpoint; a ps error; the
 * wait ran out); -2 on abort. */
int pipe_ps_pull(pipe_ps *p, float *params, int64_t min_step, double wait_secs, int (*abort)(void),
                 int64_t *step, char *err, size_t errlen);

/* After a pull that ran out waiting for min_step: which stages the shards
 * still wait for (GET /v1/sync: the gradients each has for its step),
 * written to out as "; ps 0 waits for the gradients of stage 1 of replica
 * 0 (task 1)"; the grid rule: task t is stage t mod K of replica t / K. */
void pipe_ps_missing(pipe_ps *p, const size_t *poff, const size_t *pn, int K, int R, int64_t min_step, char *out,
                     size_t cap);

/* Push grads (the stage's run, as params) to every shard that holds some of
 * the stage's pieces, stamped worker, step, batch_size and, when finite, the
 * loss; push_id makes a retry harmless. 0, or -1 with err. */
int pipe_ps_push(pipe_ps *p, const float *grads, int worker, int64_t step, int batch_size, double loss,
                 const char *push_id, char *err, size_t errlen);

#endif
