/* pipeline_ps.c - a pipeline stage's variables on the ps tasks: its pieces of
 * the placement, the pull of the shards that hold them, the push of its
 * gradients (see pipeline_ps.h). */
#include "pipeline/pipeline_ps.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "safetensors.h"

static int in_run(const place_piece *pc, size_t off, size_t n)
{
    return pc->offset >= off && pc->offset + pc->numel <= off + n && pc->numel > 0;
}

int pipe_ps_init(pipe_ps *p, ps_client *c, const model_layout *L, place_policy policy,
                 uint64_t partition_bytes, size_t off, size_t n, char *err, size_t errlen)
{
    memset(p, 0, sizeof(*p));
    p->c = c;
    p->off = off;
    p->n = n;
    if (placement_compute(&p->pl, L, ps_shards(c), policy, partition_bytes, err, errlen) != 0)
        return -1;
    const int nps = p->pl.n_ps;
    int *mine = calloc((size_t)nps, sizeof(int)), *all = calloc((size_t)nps, sizeof(int));
    if (!mine || !all)
        goto oom;
    for (int k = 0; k < p->pl.n; k++) {
        all[p->pl.pieces[k].ps]++;
        mine[p->pl.pieces[k].ps] += in_run(&p->pl.pieces[k], off, n);
    }
    for (int i = 0; i < nps; i++)
        p->n_sh += mine[i] > 0;
    if (!(p->sh = calloc((size_t)(p->n_sh ? p->n_sh : 1), sizeof(*p->sh))))
        goto oom;
    for (int i = 0, j = 0; i < nps; i++) {
        if (!mine[i])
            continue;
        pipe_ps_shard *s = &p->sh[j++];
        s->ps = i;
        if (!(s->p = malloc(sizeof(int) * (size_t)mine[i])))
            goto oom;
        for (int k = 0; k < p->pl.n; k++)
            if (p->pl.pieces[k].ps == i && in_run(&p->pl.pieces[k], off, n)) {
                s->p[s->n_p++] = k;
                s->floats += p->pl.pieces[k].numel;
            }
        /* the whole shard's body: its variables, and room for the header */
        s->rx_cap = (size_t)p->pl.bytes[i] + 4096 + 256 * (size_t)all[i];
        if (!(s->rx = malloc(s->rx_cap)) || !(s->stage = malloc(sizeof(float) * s->floats)))
            goto oom;
        memset(s->rx, 0, s->rx_cap); /* faulted in now, not on the first pull */
    }
    free(mine);
    free(all);
    return 0;
oom:
    free(mine);
    free(all);
    snprintf(err, errlen, "out of memory for the ps buffers");
    return -1;
}

void pipe_ps_free(pipe_ps *p)
{
    for (int i = 0; p->sh && i < p->n_sh; i++) {
        free(p->sh[i].p);
        free(p->sh[i].rx);
        free(p->sh[i].stage);
    }
    free(p->sh);
    p->sh = NULL;
    p->n_sh = 0;
    placement_free(&p->pl);
}

void pipe_ps_pushers(const placement *pl, const size_t *poff, const size_t *pn, int K, int R, int *out)
{
    for (int i = 0; i < pl->n_ps; i++) {
        int stages = 0;
        for (int k = 0; k < K; k++) {
            int has = 0;
            for (int j = 0; j < pl->n && !has; j++)
                has = pl->pieces[j].ps == i && in_run(&pl->pieces[j], poff[k], pn[k]);
            stages += has;
        }
        out[i] = (stages ? stages : K) * R;
    }
}

/* The stage's pieces of shard s's pulled body (len bytes) into params. */
static int unpack(pipe_ps *p, pipe_ps_shard *s, size_t len, float *params, char *err, size_t errlen)
{
    st_file f;
    char e[256];
    if (st_parse(s->rx, len, &f, e, sizeof(e)) != 0) {
        snprintf(err, errlen, "ps %d sent a bad /v1/params body: %s", s->ps, e);
        return -1;
    }
    int rc = 0;
    for (int k = 0; k < s->n_p && !rc; k++) {
        const place_piece *pc = &p->pl.pieces[s->p[k]];
        int j = st_find(&f, pc->name);
        if (j < 0 || strcmp(f.tensors[j].dtype, "F32") != 0 || f.tensors[j].end - f.tensors[j].begin != pc->numel * 4) {
            snprintf(err, errlen, "ps %d has no variable '%s' of %zu floats", s->ps, pc->name, pc->numel);
            rc = -1;
        } else {
            memcpy(params + (pc->offset - p->off), s->rx + f.data_start + f.tensors[j].begin, pc->numel * 4);
        }
    }
    st_file_free(&f);
    return rc;
}

int pipe_ps_pull(pipe_ps *p, float *params, int64_t min_step, double wait_secs, int (*abort)(void),
                 int64_t *step, char *err, size_t errlen)
{
    if (p->n_sh == 0) {
        *step = min_step;
        return 0;
    }
    const double deadline = clk_mono_secs() + wait_secs;
    ps_pull_req r[p->n_sh];
    for (;;) {
        double t0 = clk_mono_secs(), left = deadline - t0;
        long tmo = left > 30 ? 30000 : left > 0.001 ? (long)(left * 1000) : 1;
        for (int i = 0; i < p->n_sh; i++)
            r[i] = (ps_pull_req){.shard = p->sh[i].ps, .min_step = min_step, .timeout_ms = tmo, .worker = -1,
                                 .buf = p->sh[i].rx, .cap = p->sh[i].rx_cap};
        int rc = ps_pull_params_many(p->c, r, p->n_sh);
        if (rc != PS_OK) {
            if (abort && abort())
                return -2;
            snprintf(err, errlen, "pull: %s", ps_error(p->c));
            return -1;
        }
        int behind = 0;
        for (int i = 0; i < p->n_sh; i++) {
            if (unpack(p, &p->sh[i], r[i].len, params, err, errlen) != 0)
                return -1;
            p->sh[i].step = r[i].global_step;
            int64_t want = min_step >= 0 ? min_step : p->sh[0].step;
            if (r[i].global_step > want) {
                snprintf(err, errlen, "ps %d is at step %lld, %s at step %lld: a ps restarted from a checkpoint of "
                                      "another step, or another job trains on it",
                         p->sh[i].ps, (long long)r[i].global_step, min_step >= 0 ? "this stage" : "ps",
                         (long long)want);
                return -1;
            }
            if (r[i].global_step < want) {
                if (min_step < 0) {
                    snprintf(err, errlen, "ps %d is at step %lld, ps %d at step %lld: a ps restarted from a "
                                          "checkpoint of another step",
                             p->sh[i].ps, (long long)r[i].global_step, p->sh[0].ps, (long long)want);
                    return -1;
                }
                behind = 1;
            }
        }
        if (!behind) {
            *step = p->sh[0].step;
            return 0;
        }
        if (abort && abort())
            return -2;
        if (clk_mono_secs() >= deadline) {
            for (int i = 0; i < p->n_sh; i++)
                if (p->sh[i].step < min_step) {
                    snprintf(err, errlen, "ps %d stayed at step %lld within %.0f s, this stage waits for step %lld: "
                                          "a stage of another replica died or is stuck, or the ps restarted and lost "
                                          "the step's gradients",
                             p->sh[i].ps, (long long)p->sh[i].step, wait_secs, (long long)min_step);
                    break;
                }
            return -1;
        }
        if (clk_mono_secs() - t0 < 0.05) { /* answered at once: do not spin */
            struct timespec ts = {0, 20 * 1000000L};
            nanosleep(&ts, NULL);
        }
    }
}

void pipe_ps_missing(pipe_ps *p, const size_t *poff, const size_t *pn, int K, int R, int64_t min_step, char *out,
                     size_t cap)
{
    size_t at = 0;
    out[0] = 0;
    ps_set_retry_ms(p->c, 0);
    for (int i = 0; i < p->n_sh && at + 1 < cap; i++) {
        if (p->sh[i].step >= min_step)
            continue;
        json_t *j = NULL;
        if (ps_json(p->c, p->sh[i].ps, "GET", "/v1/sync", NULL, 1, &j) != PS_OK) {
            at += (size_t)snprintf(out + at, cap - at, "; ps %d: %s", p->sh[i].ps, ps_error(p->c));
            continue;
        }
        json_t *have = json_object_get(j, "have");
        int n = 0;
        for (int t = 0; t < K * R && at + 1 < cap; t++) {
            const int st = t % K;
            int holds = 0, in = 0;
            for (int k = 0; k < p->pl.n && !holds; k++)
                holds = p->pl.pieces[k].ps == p->sh[i].ps && in_run(&p->pl.pieces[k], poff[st], pn[st]);
            for (size_t u = 0; u < json_array_size(have) && !in; u++)
                in = json_integer_value(json_array_get(have, u)) == t;
            if (holds && !in)
                at += (size_t)snprintf(out + at, cap - at, "%s stage %d of replica %d (task %d)",
                                       n++ ? "," : "; ps waits for the step's gradients of", st, t / K, t);
        }
        json_decref(j);
    }
    if (at >= cap)
        out[cap - 1] = 0;
}

int pipe_ps_push(pipe_ps *p, const float *grads, int worker, int64_t step, int batch_size, double loss,
                 const char *push_id, char *err, size_t errlen)
{
    if (p->n_sh == 0)
        return 0;
    char w[16], stp[32], ls[40], batch[16];
    snprintf(w, sizeof(w), "%d", worker);
    snprintf(stp, sizeof(stp), "%lld", (long long)step);
    snprintf(ls, sizeof(ls), "%.9g", loss);
    snprintf(batch, sizeof(batch), "%d", batch_size);
    const char *meta[] = {"worker", w, "step", stp, "batch_size", batch, "loss", ls};
    ps_push_req r[p->n_sh];
    char *heads[p->n_sh];
    memset(heads, 0, sizeof(heads));
    int rc = 0;
    for (int i = 0; i < p->n_sh; i++) {
        pipe_ps_shard *s = &p->sh[i];
        st_desc d[s->n_p];
        size_t at = 0;
        for (int k = 0; k < s->n_p; k++) {
            const place_piece *pc = &p->pl.pieces[s->p[k]];
            d[k] = (st_desc){pc->name, "F32", &pc->shape};
            memcpy(s->stage + at, grads + (pc->offset - p->off), pc->numel * 4);
            at += pc->numel;
        }
        size_t hl;
        char e[256];
        if (st_header_build(d, s->n_p, meta, isfinite(loss) ? 4 : 3, &heads[i], &hl, e, sizeof(e)) != 0) {
            snprintf(err, errlen, "%s", e);
            rc = -1;
            goto out;
        }
        r[i] = (ps_push_req){.shard = s->ps, .head = heads[i], .head_len = hl, .data = s->stage,
                             .data_len = s->floats * 4, .push_id = push_id};
    }
    if (ps_push_grads_many(p->c, r, p->n_sh) != PS_OK) {
        snprintf(err, errlen, "push: %s", ps_error(p->c));
        rc = -1;
    }
    for (int i = 0; i < p->n_sh && !rc; i++)
        if (r[i].outcome == PS_PUSH_STALE) { /* the ps moved on without this stage's gradient */
            snprintf(err, errlen, "ps %d dropped the gradient of step %lld as stale (it is at step %lld)",
                     p->sh[i].ps, (long long)step, (long long)r[i].global_step);
            rc = -1;
        }
out:
    for (int i = 0; i < p->n_sh; i++)
        free(heads[i]);
    return rc;
}
