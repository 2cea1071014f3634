/* workers.c - per-worker records. (stub: filled in by the metrics work) */
#include "workers.h"

#include <stdlib.h>

struct workers {
    int unused;
};

struct workers *workers_new(void) { return calloc(1, sizeof(struct workers)); }
void workers_free(struct workers *w) { free(w); }
void workers_seen(struct workers *w, long long worker, long long step, long long batch_size,
                  int outcome)
{
    (void)w;
    (void)batch_size;
    (void)worker;
    (void)step;
    (void)outcome;
}
json_t *workers_json(struct workers *w)
{
    (void)w;
    return json_array();
}
int workers_live(struct workers *w, double secs)
{
    (void)w;
    (void)secs;
    return 0;
}

void workers_status(struct workers *w, struct store *s, json_t *status)
{
    (void)w;
    (void)s;
    (void)status;
}
