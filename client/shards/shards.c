/* shards.c - the model over the ps tasks: bulk pull and push (see shards.h). */
#include "shards/shards.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

int shards_init(shards *sh, ps_client *c, const model_layout *L, place_policy policy,
                uint64_t partition_bytes, char *err, size_t errlen)
{
    memset(sh, 0, sizeof(*sh));
    sh->c = c;
    sh->L = L;
    sh->n = ps_shards(c);
    sh->guard = -1;
    if (placement_compute(&sh->pl, L, sh->n, policy, partition_bytes, err, errlen) != 0)
        return -1;
    sh->s = calloc((size_t)sh->n, sizeof(shard));
    if (!sh->s)
        goto oom;
    for (int i = 0; i < sh->n; i++)
        if (!(sh->s[i].p = malloc(sizeof(int) * (size_t)(sh->pl.n ? sh->pl.n : 1))))
            goto oom;
    for (int k = 0; k < sh->pl.n; k++) {
        shard *s = &sh->s[sh->pl.pieces[k].ps];
        s->p[s->n_p++] = k;
        s->floats += sh->pl.pieces[k].numel;
    }
    for (int i = 0; i < sh->n; i++) {
        shard *s = &sh->s[i];
        s->contiguous = 1;
        for (int k = 1; k < s->n_p; k++) {
            const place_piece *a = &sh->pl.pieces[s->p[k - 1]], *b = &sh->pl.pieces[s->p[k]];
            if (b->offset != a->offset + a->numel)
                s->contiguous = 0;
        }
        s->first = s->n_p ? sh->pl.pieces[s->p[0]].offset : 0;
        /* header room: names, shapes, offsets and metadata are small */
        s->rx_cap = s->floats * 4 + 4096 + 256 * (size_t)s->n_p;
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

int shards_set_wire(shards *sh, wire_dtype d)
{
    sh->wire = d;
    sh->loss_scale = d == WIRE_F16 ? SHARDS_SCALE_START : 1.0;
    sh->clean = 0;
    for (int i = 0; i < sh->n; i++) {
        free(sh->s[i].wbuf);
        sh->s[i].wbuf = NULL;
        if (d != WIRE_F32 && !(sh->s[i].wbuf = malloc(sh->s[i].floats * 2 + 2)))
            return -1;
    }
    return 0;
}

int shards_set_topk(shards *sh, double ratio)
{
    topk_free(&sh->tk);
    return ratio > 0 ? topk_init(&sh->tk, ratio, sh->L->n_params) : 0;
}

void shards_free(shards *sh)
{
    for (int i = 0; sh->s && i < sh->n; i++) {
        free(sh->s[i].wbuf);
        free(sh->s[i].rx);
        free(sh->s[i].stage);
        free(sh->s[i].p);
    }
    free(sh->s);
    sh->s = NULL;
    placement_free(&sh->pl);
    topk_free(&sh->tk);
}

int shards_create(shards *sh, const float *params, int *created, int *existing)
{
    *created = *existing = 0;
    for (int k = 0; k < sh->pl.n; k++) {
        const place_piece *pc = &sh->pl.pieces[k];
        int was_created = 0;
        int rc = ps_put(sh->c, pc->ps, pc->name, &pc->shape, params + pc->offset, 1, &was_created);
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

int shards_put_back(shards *sh, int i, const float *params, int *n)
{
    *n = 0;
    for (int k = 0; k < sh->s[i].n_p; k++) {
        const place_piece *pc = &sh->pl.pieces[sh->s[i].p[k]];
        int was_created = 0;
        int rc = ps_put(sh->c, pc->ps, pc->name, &pc->shape, params + pc->offset, 0, &was_created);
        if (rc != PS_OK)
            return rc;
        (*n)++;
    }
    return PS_OK;
}

/* Copy the pieces of one pulled safetensors body into params. With
 * *missing (guarded pulls) a variable that is not there sets it and nothing
 * is copied; else it is an error. */
static int unpack(shards *sh, int i, size_t len, float *params, int *missing)
{
    st_file f;
    char err[256];
    shard *s = &sh->s[i];
    if (st_parse(s->rx, len, &f, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: ps %d sent a bad /v1/params body: %s\n", i, err);
        return PS_EPROTO;
    }
    int rc = PS_OK;
    for (int pass = missing ? 0 : 1; pass < 2 && rc == PS_OK; pass++)
        for (int k = 0; k < s->n_p; k++) {
            const place_piece *pc = &sh->pl.pieces[s->p[k]];
            int j = st_find(&f, pc->name);
            int dt = j < 0 ? -1 : wire_dtype_of_st(f.tensors[j].dtype);
            if (j < 0 || dt < 0 || f.tensors[j].end - f.tensors[j].begin != pc->numel * wire_dtype_size((wire_dtype)dt)) {
                if (missing && j < 0) {
                    *missing = 1;
                    pass = 2; /* nothing copied */
                    break;
                }
                fprintf(stderr, "workerd: ps %d has no variable '%s' of %zu floats\n", i, pc->name,
                        pc->numel);
                rc = PS_EPROTO;
                break;
            }
            if (pass == 1 && !params) /* streaming: the overlap copies it */
                continue;
            if (pass == 1 && dt == WIRE_F32)
                memcpy(params + pc->offset, s->rx + f.data_start + f.tensors[j].begin, pc->numel * 4);
            else if (pass == 1) /* 16-bit: widened (the ps checked them finite as float32) */
                wire_decode((wire_dtype)dt, s->rx + f.data_start + f.tensors[j].begin, pc->numel, 1.0f,
                            params + pc->offset);
        }
    st_file_free(&f);
    return rc;
}

/* Shard i's answer (len bytes in its rx, at global_step gs) into params,
 * unless it came back behind this task or empty (guarded pulls: its back
 * set); *step = gs for ps 0. */
static int take_answer(shards *sh, float *params, int i, size_t len, int64_t gs, int64_t *step)
{
    shard *s = &sh->s[i];
    int missing = 0, rc;
    if (sh->guard >= 0 && s->n_p > 0 && gs < s->step - sh->guard) {
        s->back = 1; /* behind this task: its values are older than ours */
    } else {
        if ((rc = unpack(sh, i, len, params, sh->guard >= 0 ? &missing : NULL)) != PS_OK)
            return rc;
        s->back = missing ? 2 : 0;
    }
    if (s->back) {
        s->back_step = gs;
        return PS_OK;
    }
    s->step = gs;
    if (i == 0)
        *step = gs;
    return PS_OK;
}

static void count_back(shards *sh)
{
    sh->n_back = 0;
    for (int i = 0; i < sh->n; i++)
        sh->n_back += sh->s[i].back != 0;
}

/* Pull shards [from, to) at once (shard 0 always, the others when they hold
 * part of the model); want[i] < 0: no wait. min_clock/clock > 0: the
 * stale-synchronous wait and announcement, on ps 0. *step: ps 0's, when
 * it is in the range. */
static int pull_range(shards *sh, float *params, const int64_t *want, long timeout_ms, int worker,
                      int64_t min_clock, int64_t clock, int from, int to, int64_t *step)
{
    ps_pull_req r[sh->n];
    int n = 0;
    for (int i = from; i < to; i++)
        if (i == 0 || sh->s[i].n_p > 0) /* a ps that holds nothing of the model is left alone */
            r[n++] = (ps_pull_req){.shard = i, .min_step = want[i], .timeout_ms = timeout_ms,
                                   .worker = worker, .min_clock = i == 0 ? min_clock : 0,
                                   .clock = i == 0 ? clock : 0,
                                   .dtype = sh->wire == WIRE_F32 ? NULL : wire_dtype_name(sh->wire),
                                   .buf = sh->s[i].rx,
                                   .cap = sh->s[i].rx_cap,
                                   .landed = sh->st.pull ? sh->st.landed : NULL,
                                   .landed_arg = sh->st.arg};
    if (n == 0)
        return PS_OK;
    int rc = ps_pull_params_many(sh->c, r, n);
    if (rc != PS_OK)
        return rc;
    for (int k = 0; k < n; k++)
        if ((rc = take_answer(sh, sh->st.pull ? NULL : params, r[k].shard, r[k].len, r[k].global_step, step)) !=
            PS_OK)
            return rc;
    count_back(sh);
    return PS_OK;
}

static int pull_all(shards *sh, float *params, const int64_t *want, long timeout_ms, int worker,
                    int64_t *step)
{
    return pull_range(sh, params, want, timeout_ms, worker, 0, 0, 0, sh->n, step);
}

int shards_pull_ssp(shards *sh, float *params, int worker, int64_t clock, int64_t min_clock,
                    long timeout_ms, int64_t *step)
{
    int64_t want[sh->n];
    for (int i = 0; i < sh->n; i++)
        want[i] = i == 0 ? 0 : -1;
    if (min_clock <= 0)
        return pull_range(sh, params, want, timeout_ms, worker, min_clock, clock, 0, sh->n, step);
    /* the bound is waited for on ps 0; the other shards are read once it
     * holds, so that they too have the slow workers' updates it waited for
     * (read at the same time, they were as they stood before the wait) */
    int rc = pull_range(sh, params, want, timeout_ms, worker, min_clock, clock, 0, 1, step);
    if (rc != PS_OK)
        return rc;
    int64_t ignored;
    return pull_range(sh, params, want, timeout_ms, worker, 0, 0, 1, sh->n, &ignored);
}

int shards_pull(shards *sh, float *params, int64_t min_step, long timeout_ms, int64_t *step)
{
    int64_t want[sh->n];
    for (int i = 0; i < sh->n; i++)
        want[i] = min_step;
    return pull_all(sh, params, want, timeout_ms, -1, step);
}

int shards_pull_sync(shards *sh, float *params, int worker, long timeout_ms, int64_t last_step,
                     int64_t *step, int *behind)
{
    *behind = 0;
    int64_t want[sh->n];
    for (int i = 0; i < sh->n; i++)
        want[i] = sh->s[i].want > 0 ? sh->s[i].want : 0;
    /* training is over once ps 0 reached the last step: the others are read
     * as they are (after a restart one may stand behind) */
    if (want[0] >= last_step)
        for (int i = 1; i < sh->n; i++)
            want[i] = 0;
    int rc = pull_all(sh, params, want, timeout_ms, worker, step);
    if (rc != PS_OK)
        return rc;
    for (int i = 0; i < sh->n; i++)
        if (sh->s[i].n_p > 0 && sh->s[i].step < want[i])
            *behind = 1;
    return PS_OK;
}

void shards_rewind(shards *sh)
{
    for (int i = 0; i < sh->n; i++)
        sh->s[i].want = 0;
}

int shards_push(shards *sh, const float *grads, const push_meta *m, int64_t *step, int *outcome)
{
    return shards_push_extra(sh, grads, m, NULL, step, outcome);
}

/* Each shard's dense gradients, float32 and contiguous (gathered into its
 * stage when its pieces are not one run of grads): dense[i]. */
static void gather(shards *sh, const float *grads, const float **dense)
{
    for (int i = 0; i < sh->n; i++) {
        shard *s = &sh->s[i];
        dense[i] = grads + s->first;
        if (s->contiguous || s->n_p == 0)
            continue;
        size_t at = 0;
        for (int k = 0; k < s->n_p; k++) {
            const place_piece *pc = &sh->pl.pieces[s->p[k]];
            memcpy(s->stage + at, grads + pc->offset, pc->numel * 4);
            at += pc->numel;
        }
        dense[i] = s->stage;
    }
}

/* 16-bit wire: every shard's gradients cast into its wbuf, times the loss
 * scale (fp16), which is halved until no element overflows (and doubled
 * after SHARDS_SCALE_GROWTH_STEPS clean pushes). A gradient that is not
 * finite as float32, or past fp16's range at scale 1, goes out as it is:
 * the ps refuses it, as it refuses a float32 NaN. */
static void encode_all(shards *sh, const float **dense)
{
    if (sh->wire == WIRE_F16 && ++sh->clean > SHARDS_SCALE_GROWTH_STEPS && sh->loss_scale < WIRE_LOSS_SCALE_MAX) {
        sh->loss_scale *= 2;
        sh->clean = 0;
    }
    for (;;) {
        int over = 0;
        for (int i = 0; i < sh->n && !over; i++)
            if (sh->s[i].n_p > 0 &&
                wire_encode(sh->wire, dense[i], sh->s[i].floats, (float)sh->loss_scale, sh->s[i].wbuf) >= 0)
                over = sh->wire == WIRE_F16 && sh->loss_scale > 1 &&
                       tensor_find_nonfinite(dense[i], sh->s[i].floats) < 0;
        if (!over)
            return;
        sh->loss_scale /= 2; /* overflow: back off, cast again */
        sh->clean = 0;
        sh->backoffs++;
    }
}

/* Streaming pushes: piece k of shard i's body (last layer first) may be
 * read once its layer's gradients are there. */
typedef struct push_gate {
    shards *sh;
    int i;
} push_gate;

static int gate_piece(void *arg, int k)
{
    const push_gate *g = arg;
    const shard *s = &g->sh->s[g->i];
    const place_piece *pc = &g->sh->pl.pieces[s->p[s->n_p - 1 - k]];
    return g->sh->st.layer_ready(g->sh->st.arg, g->sh->L->tensors[pc->tensor].layer);
}

/* --topk_ratio: shard i's body (its dense gradients at dense, in piece
 * order; wbuf's 16-bit ones) with each piece that gets smaller as its pick,
 * "NAME:ids" (I32) and "NAME:values" (the wire's dtype: F32 or BF16; F32
 * with fp16), the others whole; descriptors into d (2 n_p room), the bytes
 * into b. 0, or -1 out of memory. */
typedef struct topk_body {
    char *names;          /* 2 n_p names of TOPK_NAME bytes */
    tensor_shape *shapes; /* 2 n_p */
    unsigned char *data;
    size_t len;
    int nd;
} topk_body;
#define TOPK_NAME (TENSOR_NAME_MAX + 16)

static int topk_build(shards *sh, int i, const float *dense, st_desc *d, topk_body *b)
{
    const shard *s = &sh->s[i];
    const size_t esize = wire_dtype_size(sh->wire);
    const int bf16 = sh->wire == WIRE_BF16;
    const size_t vsize = bf16 ? 2 : 4;
    b->names = malloc((size_t)(2 * s->n_p + 1) * TOPK_NAME);
    b->shapes = malloc(sizeof(tensor_shape) * (size_t)(2 * s->n_p + 1));
    b->data = malloc(s->floats * esize + 8);
    if (!b->names || !b->shapes || !b->data)
        return -1;
    size_t pos = 0; /* floats of the shard before this piece */
    b->len = 0;
    b->nd = 0;
    for (int k = 0; k < s->n_p; k++) {
        const place_piece *pc = &sh->pl.pieces[s->p[k]];
        const int64_t numel = (int64_t)pc->numel;
        int64_t kk = topk_count(&sh->tk, numel, vsize, esize);
        if (kk > 0 && tensor_find_nonfinite(dense + pos, pc->numel) >= 0)
            kk = 0; /* whole: the ps refuses it, as it refuses any NaN */
        if (kk > 0) {
            /* (picked aside: the body's bytes need not be 4-byte aligned
             * after a 16-bit piece of an odd count) */
            int32_t *ids = malloc(sizeof(int32_t) * (size_t)kk);
            float *vals = malloc(sizeof(float) * (size_t)kk);
            if (!ids || !vals || topk_pick(&sh->tk, dense + pos, pc->offset, numel, kk, ids, vals) != 0) {
                free(ids);
                free(vals);
                return -1;
            }
            memcpy(b->data + b->len, ids, 4 * (size_t)kk);
            unsigned char *v = b->data + b->len + 4 * (size_t)kk;
            if (bf16) {
                wire_encode(WIRE_BF16, vals, (size_t)kk, 1.0f, v);
                for (int64_t j = 0; j < kk; j++) { /* the cast's rounding stays behind */
                    float sent;
                    wire_decode(WIRE_BF16, v + 2 * j, 1, 1.0f, &sent);
                    topk_keep_rounding(&sh->tk, pc->offset, ids[j], vals[j], sent);
                }
            } else {
                memcpy(v, vals, 4 * (size_t)kk);
            }
            free(ids);
            free(vals);
            b->len += (4 + vsize) * (size_t)kk;
            for (int h = 0; h < 2; h++) {
                char *nm = b->names + (size_t)b->nd * TOPK_NAME;
                snprintf(nm, TOPK_NAME, "%s%s", pc->name, h ? ":values" : ":ids");
                b->shapes[b->nd] = (tensor_shape){.ndim = 1, .dims = {kk}};
                d[b->nd] = (st_desc){nm, h ? (bf16 ? "BF16" : "F32") : "I32", &b->shapes[b->nd]};
                b->nd++;
            }
        } else {
            const void *src = sh->wire == WIRE_F32 ? (const void *)(dense + pos) : (const void *)(s->wbuf + pos);
            memcpy(b->data + b->len, src, pc->numel * esize);
            b->len += pc->numel * esize;
            topk_sent_whole(&sh->tk, pc->offset, numel);
            d[b->nd++] = (st_desc){pc->name, wire_dtype_st(sh->wire), &pc->shape};
        }
        pos += pc->numel;
    }
    return 0;
}

static void topk_body_free(topk_body *b)
{
    free(b->names);
    free(b->shapes);
    free(b->data);
}

/* One push to every shard (ret: with each shard's variables back into
 * params, shards_push_pull). */
static int push_all(shards *sh, const float *grads, const push_meta *m, const shard_extra *extra, float *ret,
                    int64_t min_clock, int64_t clock, long timeout_ms, int64_t *step, int *outcome)
{
    char worker[16], stp[sh->n][32], loss[40], batch[16], clk[32], scale[32];
    snprintf(clk, sizeof(clk), "%lld", (long long)m->clock);
    snprintf(worker, sizeof(worker), "%d", m->worker);
    snprintf(loss, sizeof(loss), "%.9g", m->loss);
    snprintf(batch, sizeof(batch), "%d", m->batch_size);
    ps_push_req r[sh->n];
    char *heads[sh->n];
    unsigned char *joined[sh->n]; /* a shard's dense gradients and extra tensors, one after the other */
    const float *dense[sh->n];
    ps_part *parts[sh->n]; /* streaming: the pieces, last layer first, straight from grads */
    push_gate gates[sh->n];
    const int tk = sh->tk.ratio > 0 && !extra;
    const int stream = sh->st.push && sh->wire == WIRE_F32 && !extra && !tk;
    topk_body tb[sh->n];
    memset(tb, 0, sizeof(tb));
    memset(heads, 0, sizeof(heads));
    memset(joined, 0, sizeof(joined));
    memset(parts, 0, sizeof(parts));
    memset(dense, 0, sizeof(dense));
    if (!stream) /* (streaming reads each piece only once it is there) */
        gather(sh, grads, dense);
    if (sh->wire != WIRE_F32)
        encode_all(sh, dense);
    snprintf(scale, sizeof(scale), "%.0f", sh->loss_scale);
    const size_t esize = wire_dtype_size(sh->wire);
    int rc = PS_OK, n = 0;
    for (int i = 0; i < sh->n; i++) {
        shard *s = &sh->s[i];
        const int ne = extra ? extra[i].n : 0;
        if (s->n_p == 0 && ne == 0)
            continue; /* nothing of the model there (ps 0 always holds something) */
        st_desc d[2 * s->n_p + ne + 1];
        int nd = s->n_p; /* descriptors: one a piece (--topk_ratio: two where picked) */
        if (tk && topk_build(sh, i, dense[i], d, &tb[i]) != 0) {
            fprintf(stderr, "workerd: out of memory building a push\n");
            rc = PS_ENOMEM;
            goto out;
        }
        if (stream && !(parts[i] = malloc(sizeof(ps_part) * (size_t)(s->n_p ? s->n_p : 1)))) {
            fprintf(stderr, "workerd: out of memory building a push\n");
            rc = PS_ENOMEM;
            goto out;
        }
        for (int k = 0; k < s->n_p && !tk; k++) {
            const place_piece *pc = &sh->pl.pieces[s->p[stream ? s->n_p - 1 - k : k]];
            d[k] = (st_desc){pc->name, wire_dtype_st(sh->wire), &pc->shape};
            if (stream)
                parts[i][k] = (ps_part){grads + pc->offset, pc->numel * 4};
        }
        gates[i] = (push_gate){sh, i};
        if (tk)
            nd = tb[i].nd;
        for (int k = 0; k < ne; k++)
            d[nd + k] = extra[i].d[k];
        snprintf(stp[i], sizeof(stp[i]), "%lld", (long long)s->step);
        const char *meta[14] = {"worker", worker, "step", stp[i], "loss", loss, "batch_size", batch};
        int nm = 4;
        if (m->clock >= 0) {
            meta[2 * nm] = "clock";
            meta[2 * nm++ + 1] = clk;
        }
        if (sh->wire == WIRE_F16) {
            meta[2 * nm] = "loss_scale";
            meta[2 * nm++ + 1] = scale;
        }
        char err[256];
        size_t hl;
        if (st_header_build(d, nd + ne, meta, nm, &heads[i], &hl, err, sizeof(err)) != 0) {
            fprintf(stderr, "workerd: %s\n", err);
            rc = PS_EINVAL;
            goto out;
        }
        const void *data = sh->wire == WIRE_F32 ? (const void *)dense[i] : (const void *)s->wbuf;
        size_t data_len = s->floats * esize;
        if (tk) {
            data = tb[i].data;
            data_len = tb[i].len;
        }
        if (ne > 0) {
            size_t total = data_len;
            for (int k = 0; k < ne; k++)
                total += (size_t)tensor_shape_numel(extra[i].d[k].shape) * st_dtype_size(extra[i].d[k].dtype);
            if (!(joined[i] = malloc(total ? total : 1))) {
                fprintf(stderr, "workerd: out of memory building a push\n");
                rc = PS_ENOMEM;
                goto out;
            }
            if (data_len)
                memcpy(joined[i], data, data_len);
            for (int k = 0; k < ne; k++) {
                size_t b = (size_t)tensor_shape_numel(extra[i].d[k].shape) * st_dtype_size(extra[i].d[k].dtype);
                memcpy(joined[i] + data_len, extra[i].data[k], b);
                data_len += b;
            }
            data = joined[i];
        }
        r[n++] = (ps_push_req){.shard = i, .head = heads[i], .head_len = hl, .data = data,
                               .data_len = data_len, .push_id = m->push_id};
        if (ret)
            r[n - 1] = (ps_push_req){.shard = i, .head = heads[i], .head_len = hl, .data = data,
                                     .data_len = data_len, .push_id = m->push_id,
                                     .landed = sh->st.pull ? sh->st.landed : NULL, .landed_arg = sh->st.arg,
                                     .ret_buf = s->rx,
                                     .ret_cap = s->rx_cap, .ret_min_step = -1,
                                     .ret_dtype = sh->wire == WIRE_F32 ? NULL : wire_dtype_name(sh->wire),
                                     .ret_worker = i == 0 ? m->worker : -1,
                                     .ret_min_clock = i == 0 ? min_clock : 0, .ret_clock = i == 0 ? clock : 0,
                                     .ret_timeout_ms = timeout_ms};
        if (stream) {
            r[n - 1].parts = parts[i];
            r[n - 1].n_parts = s->n_p;
            r[n - 1].gate = gate_piece;
            r[n - 1].gate_arg = &gates[i];
        }
    }
    if ((rc = ps_push_grads_many(sh->c, r, n)) != PS_OK)
        goto out;
    if (tk) /* taken: what the picks left is the residual now */
        topk_commit(&sh->tk);
    for (int i = 0; i < sh->n; i++)
        sh->s[i].want = sh->s[i].step + 1;
    *outcome = r[0].outcome;
    *step = r[0].global_step;
    if (ret) {
        for (int k = 0; k < n && rc == PS_OK; k++)
            rc = take_answer(sh, sh->st.pull ? NULL : ret, r[k].shard, r[k].ret_len, r[k].global_step, step);
        count_back(sh);
        /* stale-synchronous: when ps 0 waited for the slowest worker, the
         * other shards' answers predate the updates it waited for: read
         * them again (as shards_pull_ssp reads them after ps 0) */
        if (rc == PS_OK && min_clock > 0 && r[0].ret_waited && sh->n > 1) {
            int64_t want[sh->n], ignored;
            for (int i = 0; i < sh->n; i++)
                want[i] = -1;
            rc = pull_range(sh, ret, want, timeout_ms, m->worker, 0, 0, 1, sh->n, &ignored);
        }
    }
out:
    for (int i = 0; i < sh->n; i++) {
        free(heads[i]);
        free(joined[i]);
        free(parts[i]);
        topk_body_free(&tb[i]);
    }
    return rc;
}

int shards_push_extra(shards *sh, const float *grads, const push_meta *m, const shard_extra *extra, int64_t *step,
                      int *outcome)
{
    return push_all(sh, grads, m, extra, NULL, 0, 0, 0, step, outcome);
}

int shards_push_pull(shards *sh, const float *grads, const push_meta *m, float *params, int64_t min_clock,
                     int64_t clock, long timeout_ms, int64_t *step, int *outcome)
{
    return push_all(sh, grads, m, NULL, params, min_clock, clock, timeout_ms, step, outcome);
}
