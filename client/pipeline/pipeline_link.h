/* pipeline_link.h - a pipeline stage's connection to its neighbours over
 * HTTP: its own endpoint, which buffers what arrives in the stage's mailbox
 * (pipeline_mailbox.h), and the sends to the other stages (libcurl).
 *
 * Routes (every stage, on its own --worker_hosts / --chief_hosts address):
 *   POST /v1/pipeline/msg?step=S&mb=J&dir=act|grad|params|reduce|ring&from=F&plan=P[&example0=E]
 *        one message: raw little-endian float32, Content-Length exactly the
 *        message's size (micro-batch x the floats of one example's
 *        activation at the stage boundary; params: the sender's parameters);
 *        activations name the epoch-order index of the micro-batch's first
 *        example (example0), which dropout's mask follows.
 *        204; 400 a bad argument or size, 409 a step this stage is not at
 *        (it takes its step and the next), a duplicate, a sender that is not
 *        the neighbour the direction names, or another plan (P, a CRC-32C
 *        of the model, split, schedule, micro-batches and batch: every task
 *        must be started with the same flags); 411 no Content-Length; 413 a
 *        body larger than the message; 401 without the bearer token when the
 *        stage has one (workerd --auth_token_file). Nothing refused is buffered.
 *        Gradients may name their micro-batch's loss (loss=, a finite number:
 *        the last stage's mean over the micro-batch, passed back stage by
 *        stage), so that every stage reports it with its push to the ps.
 *        dir=reduce: with R > 1 replicas, the step's gradient sum of this
 *        stage from replica mb (= from), which every replica adds up in
 *        replica order; dir=ring (--allreduce=ring): ring step mb's chunk
 *        from the left neighbour replica (pipeline_ring.h). 503 (before the
 *        body; the sender retries): parameters before stage 0 has freed its
 *        training buffers.
 *   GET  /v1/pipeline  the plan, the table, the current step and slot, what
 *        the stage waits for and from whom, busy and idle seconds (JSON)
 *   GET  /v1/status  {"mode": "pipeline", the stage, its step and loss, and
 *        on the chief (stage 0 of replica 0) "pipeline": every stage of its
 *        replica as its /v1/pipeline says now (fetched, 1 s each), or the
 *        error that stage gave}
 *   GET  /v1/history[?since=STEP]  the replica's step losses over time, as
 *        psd's (common/history.h: bounded memory), recorded as
 *        pipe_link_set_state reports each step done with its loss
 *   GET  /healthz
 * A send retries a neighbour that does not answer yet (starting, or busy)
 * until its deadline; a refusal (4xx) is final. Nothing here exits. */
#ifndef RESTPS_PIPELINE_LINK_H
#define RESTPS_PIPELINE_LINK_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "cluster.h"
#include "pipeline/pipeline_mailbox.h"

typedef struct pipe_link pipe_link;

typedef struct pipe_link_options {
    const cluster_addr *peers; /* this replica's stages, [stages]; peers[stage] is this task */
    int stages, stage;
    const cluster_addr *replica_peers; /* this stage in every replica, [replicas] */
    int replicas, replica;
    pipe_mailbox *mailbox;     /* borrowed: where the endpoint puts what it takes */
    uint32_t plan_id;
    const char *plan_text;     /* what the plan is, for the 409 of another plan (copied) */
    const char *token;         /* bearer token wanted and sent (copied); NULL: open */
    const char *name;          /* "worker 1", for messages (copied) */
    int (*abort)(void);        /* non-zero: stop retrying a send; may be NULL */
    json_t *info;              /* GET /v1/pipeline's fixed part (stolen): plan, table, ... */
} pipe_link_options;

/* Start the endpoint on peers[stage]'s port (loopback when its host is). NULL with err. */
pipe_link *pipe_link_new(const pipe_link_options *o, char *err, size_t errlen);
void pipe_link_free(pipe_link *l);

/* POST one message to stage `to`, retrying while it does not answer, until
 * deadline (clk_mono_secs()); activations carry example0 (the micro-batch's
 * first example in the epoch order: a stage without the data needs it for
 * dropout's mask). 0; -1 with err (refused, or no answer by the deadline);
 * -2 when abort() said stop. */
int pipe_link_send(pipe_link *l, int to, const pipe_key *k, const float *data, size_t floats,
                   int64_t example0, double deadline, char *err, size_t errlen);
/* The same to this stage of replica `to` (PIPE_REDUCE, PIPE_RING). */
int pipe_link_send_replica(pipe_link *l, int to, const pipe_key *k, const float *data, size_t floats,
                           double deadline, char *err, size_t errlen);

/* A gradient message's tag (example0 in the sends, the mailbox's tag) is
 * its micro-batch's loss: pipe_loss_tag(loss) (the double's bits; a NaN:
 * none, not sent), read back with pipe_tag_loss. */
int64_t pipe_loss_tag(double loss);
double pipe_tag_loss(int64_t tag);

/* The stage's sends without waiting for them: a copy of the message goes on
 * the link's queue, which its sender thread sends in order (each as
 * pipe_link_send, or pipe_link_send_replica when replica is 1), so the stage
 * computes while its last output travels. 0, or -1 with err when an earlier
 * queued send failed (that error) or out of memory. */
int pipe_link_post(pipe_link *l, int replica, int to, const pipe_key *k, const float *data, size_t floats,
                   int64_t example0, double deadline, char *err, size_t errlen);
/* Wait until every queued message was delivered: 0; -1 with err (the first
 * failure; the rest of the queue is dropped); -2 when abort() said stop. */
int pipe_link_flush(pipe_link *l, char *err, size_t errlen);
/* 1 once a queued send failed (a receive can stop waiting). */
int pipe_link_failed(pipe_link *l);

/* What GET /v1/pipeline says of the stage now: the step and slot it is at,
 * what it waits for (waiting 0: nothing; else the key and the stage it
 * comes from), and its busy and idle seconds so far. */
typedef struct pipe_link_state {
    int64_t step;
    int slot;
    int waiting;
    pipe_key wait_key;
    int wait_from;
    double busy_secs, idle_secs;
    int done;
    double loss;  /* the last stage: the last step's mean loss; NAN: none (other stages) */
} pipe_link_state;
void pipe_link_set_state(pipe_link *l, const pipe_link_state *st);

/* "host:port" of stage s, of this stage in replica r, for messages. */
const char *pipe_link_peer(const pipe_link *l, int s);
const char *pipe_link_replica_peer(const pipe_link *l, int r);
/* Body bytes this stage sent, and the seconds its sends took. */
uint64_t pipe_link_bytes_sent(const pipe_link *l);
double pipe_link_send_secs(const pipe_link *l);

#endif
