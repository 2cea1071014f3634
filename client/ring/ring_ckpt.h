/* ring_ckpt.h - the training state in ring mode (no ps): the parameters, the
 * optimizer's slots and global_step, as one safetensors body. The chief
 * sends it to the other workers at start (GET /v1/ring/state) and writes it
 * as its checkpoints: <logdir>/model.ckpt-<global_step>.safetensors, the
 * newest of which a restart resumes from.
 *
 * Tensors: every variable under its own name (as --export writes them), then
 * each slot as "<name>:<slot>" with psd's slot names (momentum; adam_m,
 * adam_v; adagrad; rmsprop_ms, rmsprop_mom), all F32. __metadata__: format
 * "restps-ring-checkpoint", format_version "1", global_step, optimizer,
 * layers ("784,100,10"), workers (the ring's size when written), saved_at
 * (UTC), crc32c (8 hex digits, of the data section). */
#ifndef RESTPS_RING_CKPT_H
#define RESTPS_RING_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "ckptdir.h"
#include "model/model.h"
#include "optim.h"

#define RING_CKPT_FORMAT "restps-ring-checkpoint"

/* The state's buffers: params, slot0 and slot1 each layout->n_params floats
 * (the slots the optimizer does not use may be NULL). */
typedef struct ring_state {
    const model_layout *layout;
    optim_kind optimizer;
    float *params, *slot0, *slot1;
    int64_t step;
    int workers;
} ring_state;

/* The body: *out malloc'd. 0 or -1 with err. */
int ring_state_encode(const ring_state *s, void **out, size_t *len, char *err, size_t errlen);

/* Check buf and copy it into s (layout and optimizer set by the caller; step
 * and workers filled). 0; CKPT_EINVALID when it is broken (err says how: a
 * NaN or Inf in any tensor is broken too);
 * CKPT_EOTHER when it is valid but of another model or optimizer (err says
 * which). s is unchanged unless 0. */
int ring_state_decode(const void *buf, size_t len, ring_state *s, char *err, size_t errlen);

/* Write s atomically to <dir>/model.ckpt-<step>.safetensors (creating dir),
 * then keep the newest `keep` up to this one (newer ones, not this run's,
 * are left). path receives the file's name. 0 or -1 with err; -1, nothing
 * written and nothing pruned, when a parameter or slot is NaN or Inf (so the
 * newest finite checkpoint is never pruned for a diverged one). */
int ring_ckpt_write(const char *dir, const ring_state *s, int keep, char *path, size_t cap,
                    char *err, size_t errlen);

/* Resume from the newest valid checkpoint in dir (ckptdir_list's order),
 * skipping (with a line on stderr) unreadable and broken ones: what is not a
 * regular file (a FIFO is opened without blocking), and a file whose prefix,
 * header (1 MiB at most) or data size (exactly the model's and its slots'
 * floats) does not fit, before its data is read. 1 restored
 * (path set), 0 none there, -1 error (a valid one of another model or
 * optimizer, or dir unreadable), with err. */
int ring_ckpt_restore(const char *dir, ring_state *s, char *path, size_t cap, char *err,
                      size_t errlen);

#endif
