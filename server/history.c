/* history.c - (stub: filled in by the history work) */
#include "history.h"

#include <stdlib.h>

#include "routes.h"

struct history {
    int unused;
};

struct history *history_new(void) { return calloc(1, sizeof(struct history)); }
void history_free(struct history *h) { free(h); }
void history_record(struct history *h, int64_t step, int has_loss, double loss)
{
    (void)h;
    (void)step;
    (void)has_loss;
    (void)loss;
}

enum MHD_Result h_history(request *r)
{
    return http_reply_error(r, MHD_HTTP_NOT_IMPLEMENTED, "not built yet");
}

void history_status(struct history *h, json_t *status)
{
    (void)h;
    (void)status;
}
