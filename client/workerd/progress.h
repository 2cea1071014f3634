/* progress.h - workerd's progress bar on a terminal: steps, ETA, loss,
 * examples/s on one line redrawn a few times a second. Off (no output) when
 * stdout is not a terminal: the log lines every --log_every steps are for that. */
#ifndef RESTPS_PROGRESS_H
#define RESTPS_PROGRESS_H

#include <stdint.h>

typedef struct progress {
    int on;
    int64_t total;
    double t0, last_draw;
    int64_t step0;
    const char *name;
} progress;

/* on: -1 = when stdout is a terminal, 0 = never, 1 = always. */
void progress_init(progress *p, const char *name, int64_t total_steps, int on);
/* The global step is now `step`; examples_per_sec and loss for the line. */
void progress_update(progress *p, int64_t step, double loss, double examples_per_sec);
/* Clear the bar before a log line, or at the end. */
void progress_clear(progress *p);

#endif
