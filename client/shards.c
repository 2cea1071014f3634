/* shards.c - placement of the model on the ps tasks, bulk pull and push. */
#include "shards.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

int shards_init(shards *sh, ps_client *c, const mlp_layout *L, char *err, size_t errlen)
{
    memset(sh, 0, sizeof(*sh));
    sh->c = c;
    sh->L = L;
    sh->n = ps_shards(c);
    sh->s = calloc((size_t)sh->n, sizeof(shard));
    if (!sh->s)
        goto oom;
    for (int t = 0; t < L->n_tensors; t++) {
        int o = t % sh->n;
        sh->owner[t] = o;
        shard *s = &sh->s[o];
        s->t[s->n_t++] = t;
        s->floats += L->tensors[t].numel;
    }
    for (int i = 0; i < sh->n; i++) {
        shard *s = &sh->s[i];
        s->contiguous = 1;
        for (int k = 1; k < s->n_t; k++)
            if (L->tensors[s->t[k]].offset !=
                L->tensors[s->t[k - 1]].offset + L->tensors[s->t[k - 1]].numel)
                s->contiguous = 0;
        s->first = s->n_t ? L->tensors[s->t[0]].offset : 0;
        /* header room: names, shapes, offsets and metadata are small */
        s->rx_cap = s->floats * 4 + 4096 + 256 * (size_t)s->n_t;
        s->rx = malloc(s->rx_cap);
        if (!s->rx)
            goto oom;
        memset(s->rx, 0, s->rx_cap); /* fault it in now, not on the first pull */
        if (!s->contiguous) {
            s->stage = calloc(s->floats ? s->floats : 1, sizeof(float));
            if (!s->stage)
                goto oom;
        }
    }
    return 0;
oom:
    snprintf(err, errlen, "out of memory for the shard buffers");
    shards_free(sh);
    return -1;
}

void shards_free(shards *sh)
{
    for (int i = 0; sh->s && i < sh->n; i++) {
        free(sh->s[i].rx);
        free(sh->s[i].stage);
    }
    free(sh->s);
    sh->s = NULL;
}

int shards_create(shards *sh, const float *params, int *created, int *existing)
{
    *created = *existing = 0;
    for (int t = 0; t < sh->L->n_tensors; t++) {
        const mlp_tensor *mt = &sh->L->tensors[t];
        int was_created = 0;
        int rc = ps_put(sh->c, sh->owner[t], mt->name, &mt->shape, params + mt->offset, 1,
                        &was_created);
        if (rc == PS_EHTTP && ps_http_status(sh->c) == 412) {
            (*existing)++;
            continue;
        }
        if (rc != PS_OK)
            return rc;
        (*created)++;
    }
    return PS_OK;
}

/* Copy the tensors of one pulled safetensors body into params. */
static int unpack(shards *sh, int i, size_t len, float *params)
{
    st_file f;
    char err[256];
    shard *s = &sh->s[i];
    if (st_parse(s->rx, len, &f, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: ps %d sent a bad /v1/params body: %s\n", i, err);
        return PS_EPROTO;
    }
    int rc = PS_OK;
    for (int k = 0; k < s->n_t; k++) {
        const mlp_tensor *mt = &sh->L->tensors[s->t[k]];
        int j = st_find(&f, mt->name);
        if (j < 0 || strcmp(f.tensors[j].dtype, "F32") != 0 ||
            f.tensors[j].end - f.tensors[j].begin != mt->numel * 4) {
            fprintf(stderr, "workerd: ps %d has no variable '%s' of %zu floats\n", i, mt->name,
                    mt->numel);
            rc = PS_EPROTO;
            break;
        }
        memcpy(params + mt->offset, s->rx + f.data_start + f.tensors[j].begin, mt->numel * 4);
    }
    st_file_free(&f);
    return rc;
}

int shards_pull(shards *sh, float *params, int64_t min_step, long timeout_ms, int64_t *step)
{
    for (int i = 0; i < sh->n; i++) {
        size_t len;
        int64_t st;
        int rc = min_step >= 0
                     ? ps_pull_params_wait(sh->c, i, min_step, timeout_ms, sh->s[i].rx,
                                           sh->s[i].rx_cap, &len, &st)
                     : ps_pull_params(sh->c, i, sh->s[i].rx, sh->s[i].rx_cap, &len, &st);
        if (rc != PS_OK)
            return rc;
        if ((rc = unpack(sh, i, len, params)) != PS_OK)
            return rc;
        sh->s[i].step = st;
        if (i == 0)
            *step = st;
    }
    return PS_OK;
}

int shards_pull_sync(shards *sh, float *params, int worker, long timeout_ms, int64_t last_step,
                     int64_t *step, int *behind)
{
    *behind = 0;
    int over = 0;
    for (int i = 0; i < sh->n; i++) {
        size_t len;
        int64_t st;
        shard *s = &sh->s[i];
        int64_t want = s->want > 0 && !over ? s->want : 0;
        int rc = ps_pull_params_wait_worker(sh->c, i, want, timeout_ms, worker, s->rx, s->rx_cap,
                                            &len, &st);
        if (rc != PS_OK)
            return rc;
        if ((rc = unpack(sh, i, len, params)) != PS_OK)
            return rc;
        s->step = st;
        if (st < want)
            *behind = 1;
        if (i == 0) {
            *step = st;
            over = st >= last_step;
        }
    }
    return PS_OK;
}

void shards_rewind(shards *sh)
{
    for (int i = 0; i < sh->n; i++)
        sh->s[i].want = 0;
}

int shards_push(shards *sh, const float *grads, const push_meta *m, int64_t *step, int *outcome)
{
    char worker[16], stp[32], loss[40], batch[16];
    snprintf(worker, sizeof(worker), "%d", m->worker);
    snprintf(loss, sizeof(loss), "%.9g", m->loss);
    snprintf(batch, sizeof(batch), "%d", m->batch_size);
    const char *meta[] = {"worker", worker, "step", stp, "loss", loss, "batch_size", batch};
    for (int i = 0; i < sh->n; i++) {
        shard *s = &sh->s[i];
        st_desc d[MLP_MAX_TENSORS];
        for (int k = 0; k < s->n_t; k++)
            d[k] = (st_desc){sh->L->tensors[s->t[k]].name, "F32", &sh->L->tensors[s->t[k]].shape};
        char *head, err[256];
        size_t hl;
        snprintf(stp, sizeof(stp), "%lld", (long long)s->step);
        if (st_header_build(d, s->n_t, meta, 4, &head, &hl, err, sizeof(err)) != 0) {
            fprintf(stderr, "workerd: %s\n", err);
            return PS_EINVAL;
        }
        const float *data = grads + s->first;
        if (!s->contiguous) {
            size_t at = 0;
            for (int k = 0; k < s->n_t; k++) {
                const mlp_tensor *mt = &sh->L->tensors[s->t[k]];
                memcpy(s->stage + at, grads + mt->offset, mt->numel * 4);
                at += mt->numel;
            }
            data = s->stage;
        }
        int64_t st;
        int oc;
        int rc = ps_push_grads_ex(sh->c, i, head, hl, data, s->floats * 4, m->push_id, &st, &oc);
        free(head);
        if (rc != PS_OK)
            return rc;
        s->want = s->step + 1;
        if (i == 0) {
            *step = st;
            *outcome = oc;
        }
    }
    return PS_OK;
}
