/* summaries.h - what ps 0 writes for TensorBoard (common/tfevents.h) in its
 * --logdir, as an Estimator lays out its model_dir (the checkpoints' ps-N/
 * folders stay the saver's): <logdir>/train/events.out.tfevents.* with "loss" (every
 * point of GET /v1/history's "points", same step, value and time),
 * "global_step/sec", "examples/sec", "learning_rate" and "staleness"
 * (/v1/status's steps_per_sec, examples_per_sec, learning_rate and
 * staleness.mean, sampled once a second while global_step moves; staleness
 * once gradients were measured, async or stale-synchronous), and
 * <logdir>/eval/events.out.tfevents.* with the evaluator's "loss" and
 * "accuracy" (every point of /v1/history's "eval"), so that TensorBoard
 * draws the test loss over the training loss as it does for an Estimator.
 * Other ps tasks, and an empty --logdir, write none. */
#ifndef RESTPS_SUMMARIES_H
#define RESTPS_SUMMARIES_H

#include "server.h"

/* Once the store and the history exist (after the restore): on ps 0 with a
 * non-empty logdir, open the writers and attach them to the history. 0, or
 * a negative errno when they could not start (logged; psd goes on without). */
int summaries_start(server *srv, const char *logdir);
/* Once nothing records any more (after MHD_stop_daemon and the ticker):
 * detach, write what is queued, close. Safe when never started. */
void summaries_stop(server *srv);

#endif
