/* pipeline_schedule.c - the gpipe and 1f1b tables (see pipeline_schedule.h). */
#include "pipeline/pipeline_schedule.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *pipe_schedule_name(pipe_schedule_kind k)
{
    return k == PIPE_GPIPE ? "gpipe" : "1f1b";
}

int pipe_schedule_from_name(const char *name, pipe_schedule_kind *out)
{
    if (strcmp(name, "gpipe") == 0)
        *out = PIPE_GPIPE;
    else if (strcmp(name, "1f1b") == 0)
        *out = PIPE_1F1B;
    else
        return -1;
    return 0;
}

int pipe_schedule_build(pipe_schedule *s, pipe_schedule_kind kind, int K, int M, char *err,
                        size_t errlen)
{
    memset(s, 0, sizeof(*s));
    if (K < PIPE_MIN_STAGES || K > PIPE_MAX_STAGES || M < 1 || M > PIPE_MAX_MICRO) {
        snprintf(err, errlen, "a schedule of %d stages and %d micro-batches: stages must be %d to %d, "
                              "micro-batches 1 to %d",
                 K, M, PIPE_MIN_STAGES, PIPE_MAX_STAGES, PIPE_MAX_MICRO);
        return -1;
    }
    s->kind = kind;
    s->stages = K;
    s->micro = M;
    s->n = 2 * M;
    s->slot = calloc((size_t)K * (size_t)s->n, sizeof(pipe_slot));
    if (!s->slot) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (int st = 0; st < K; st++) {
        pipe_slot *t = s->slot + (size_t)st * (size_t)s->n;
        int i = 0, f = 0, b = 0;
        int warm = kind == PIPE_GPIPE ? M : (K - 1 - st < M ? K - 1 - st : M);
        for (; f < warm; f++)
            t[i++] = (pipe_slot){PIPE_FWD, f};
        while (f < M) { /* steady state: one forward, one backward */
            t[i++] = (pipe_slot){PIPE_FWD, f++};
            t[i++] = (pipe_slot){PIPE_BWD, b++};
        }
        while (b < M)
            t[i++] = (pipe_slot){PIPE_BWD, b++};
        int live = 0, most = 0;
        for (int k = 0; k < s->n; k++) {
            live += t[k].op == PIPE_FWD ? 1 : -1;
            if (live > most)
                most = live;
        }
        s->max_inflight[st] = most;
    }
    return 0;
}

void pipe_schedule_free(pipe_schedule *s)
{
    free(s->slot);
    s->slot = NULL;
}

void pipe_schedule_format(const pipe_schedule *s, int stage, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < s->n && at < len; i++) {
        const pipe_slot *t = pipe_schedule_at(s, stage, i);
        int w = snprintf(buf + at, len - at, "%s%c%d", i ? " " : "", t->op == PIPE_FWD ? 'F' : 'B', t->mb);
        if (w < 0)
            break;
        at += (size_t)w;
    }
}
