/* langid_train.c - workerd --data=langid: language identification of words
 * (data/langid.h) with an embedding bag over hashed character n-grams
 * (embed:ROWSxDIM[,mean|sum]), then the dense layers of the rest of the spec
 * and the softmax over the languages, fastText-style.
 *
 * The embedding table is a row-sparse variable: only the rows a batch
 * touches are read and updated. --local keeps it in this process (the same
 * table code as psd, common/sparse_table.h: rows held once updated, lazy
 * optimizer slots); a worker pulls the rows its batch touches from the ps
 * tasks (id mod the ps tasks, POST /v1/vars/emb/rows) and pushes only their
 * gradients, in the same POST /v1/grads body as the dense gradients, so a
 * sync step has both or neither.
 *
 * Initialization: the table uniform in [-1/dim, 1/dim) from splitmix64 of
 * (seed, id) (sparse_init_row); the hidden dense layers as model_init_params;
 * the last dense layer (sm_w, sm_b) zero, as fastText's output matrix. */
#include "workerd/langid_train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "safetensors.h"
#include "sparse_table.h"

json_t *langid_placement(const train_config *c, int ps_tasks)
{
    return json_pack("[{s:s,s:I,s:i,s:s,s:i}]", "name", "emb", "rows", (json_int_t)c->langid.rows, "dim",
                     c->langid.dim, "sharding", "id mod ps_tasks", "ps_tasks", ps_tasks);
}

int langid_parse_spec(const char *spec, langid_model *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    long long rows = 0;
    int dim = 0, used = 0;
    if (strncmp(spec, "embed:", 6) != 0 || sscanf(spec + 6, "%lldx%d%n", &rows, &dim, &used) != 2 || rows < 1 ||
        rows > ((long long)1 << 40) || dim < 1 || dim > SPARSE_DIM_MAX) {
        snprintf(err, errlen, "--data=langid needs a model embed:ROWSxDIM[,mean|sum],LAYERS... (rows 1 to 2^40, dim 1 "
                              "to %d; e.g. %s), not '%.64s'", SPARSE_DIM_MAX, LANGID_DEFAULT_SPEC, spec);
        return -1;
    }
    const char *p = spec + 6 + used;
    out->mean = 1;
    if (strncmp(p, ",mean", 5) == 0 && (p[5] == ',' || !p[5]))
        p += 5;
    else if (strncmp(p, ",sum", 4) == 0 && (p[4] == ',' || !p[4])) {
        out->mean = 0;
        p += 4;
    }
    if (*p != ',' || !p[1]) {
        snprintf(err, errlen, "the embedding bag needs the dense layers after it (e.g. %s)", LANGID_DEFAULT_SPEC);
        return -1;
    }
    out->rows = rows;
    out->dim = dim;
    snprintf(out->rest, sizeof(out->rest), "%s", p + 1);
    return 0;
}

/* ---- a batch: its bags over the rows it touches ---- */

/* Make b the batch of examples ex[0..n) of split s: labels, the distinct ids
 * (uniq, first-seen order), each bag as indices into them. 0 or -1. */
static int batch_build(langid_batch *b, const langid_split *s, const uint32_t *ex, int n)
{
    int64_t nnz = 0;
    for (int i = 0; i < n; i++)
        nnz += s->off[ex[i] + 1] - s->off[ex[i]];
    if (nnz > b->cap) {
        int64_t nc = b->cap ? b->cap : 4096;
        while (nc < nnz)
            nc *= 2;
        size_t hc = 1;
        while (hc < (size_t)nc * 2)
            hc *= 2;
        int32_t *ni = realloc(b->idx, sizeof(int32_t) * (size_t)nc);
        if (ni)
            b->idx = ni;
        int64_t *nu = realloc(b->uniq, sizeof(int64_t) * (size_t)nc);
        if (nu)
            b->uniq = nu;
        int32_t *nh = realloc(b->hash, sizeof(int32_t) * hc);
        if (nh)
            b->hash = nh;
        if (!ni || !nu || !nh)
            return -1;
        b->cap = nc;
        b->hcap = hc;
    }
    memset(b->hash, 0xff, sizeof(int32_t) * b->hcap);
    b->n = n;
    b->n_uniq = 0;
    int64_t k = 0;
    for (int i = 0; i < n; i++) {
        b->labels[i] = s->labels[ex[i]];
        b->off[i] = k;
        for (int64_t j = s->off[ex[i]]; j < s->off[ex[i] + 1]; j++) {
            int64_t id = s->ids[j];
            size_t h = (size_t)(((uint64_t)id * 0x9E3779B97F4A7C15ull) >> 20) & (b->hcap - 1);
            while (b->hash[h] >= 0 && b->uniq[b->hash[h]] != id)
                h = (h + 1) & (b->hcap - 1);
            if (b->hash[h] < 0) {
                b->hash[h] = (int32_t)b->n_uniq;
                b->uniq[b->n_uniq++] = id;
            }
            b->idx[k++] = b->hash[h];
        }
    }
    b->off[n] = k;
    return 0;
}

void langid_init_params(const train_config *c, float *params)
{
    model_init_params(&c->layout, params, c->seed);
    /* the last dense layer starts at zero (fastText's output matrix) */
    for (int k = c->layout.n_tensors - 2; k < c->layout.n_tensors; k++)
        memset(params + c->layout.tensors[k].offset, 0, sizeof(float) * c->layout.tensors[k].numel);
}

int langid_state_init(langid_state *st, const train_config *c, int max_batch, char *err, size_t errlen)
{
    memset(st, 0, sizeof(*st));
    st->c = c;
    const langid_model *lm = &c->langid;
    if (langid_load(c->data_dir_langid, lm->rows, c->langid_words, &st->ds, err, errlen) != 0)
        return -1;
    if (st->ds.n_langs != c->layout.n_classes) {
        snprintf(err, errlen, "langid: %d languages, the model has %d classes", st->ds.n_langs, c->layout.n_classes);
        return -1;
    }
    if (!(st->m = model_new(model_device_backend(), &c->layout, max_batch, err, errlen)))
        return -1;
    const size_t P = c->layout.n_params, D = (size_t)lm->dim, C = (size_t)c->layout.n_classes;
    st->params = calloc(P, sizeof(float));
    st->grads = calloc(P, sizeof(float));
    st->x = calloc((size_t)max_batch * D, sizeof(float));
    st->dx = calloc((size_t)max_batch * D, sizeof(float));
    st->logits = calloc((size_t)max_batch * C, sizeof(float));
    st->dlogits = calloc((size_t)max_batch * C, sizeof(float));
    st->b.labels = calloc((size_t)max_batch, 1);
    st->b.off = calloc((size_t)max_batch + 1, sizeof(int64_t));
    st->order = calloc((size_t)(st->ds.train.n ? st->ds.train.n : 1), sizeof(uint32_t));
    st->test_ex = calloc((size_t)max_batch, sizeof(uint32_t));
    if (!st->params || !st->grads || !st->x || !st->dx || !st->logits || !st->dlogits || !st->b.labels || !st->b.off ||
        !st->order || !st->test_ex) {
        snprintf(err, errlen, "langid: out of memory");
        return -1;
    }
    st->decl = (sparse_decl){.rows = lm->rows, .dim = lm->dim, .max_rows = lm->rows, .init = SPARSE_INIT_UNIFORM,
                             .init_scale = 1.0f / (float)lm->dim, .seed = c->seed, .shard = 0, .shards = 1};
    langid_init_params(c, st->params);
    st->epoch = -1;
    return 0;
}

void langid_state_free(langid_state *st)
{
    model_free(st->m);
    langid_free(&st->ds);
    free(st->params);
    free(st->grads);
    free(st->s0);
    free(st->s1);
    free(st->x);
    free(st->dx);
    free(st->logits);
    free(st->dlogits);
    free(st->rows);
    free(st->drows);
    free(st->b.labels);
    free(st->b.off);
    free(st->b.idx);
    free(st->b.uniq);
    free(st->b.hash);
    free(st->order);
    free(st->test_ex);
    memset(st, 0, sizeof(*st));
}

/* Room for the rows of the batch built last (rows and drows). 0 or -1. */
static int rows_room(langid_state *st)
{
    const size_t need = (size_t)(st->b.n_uniq ? st->b.n_uniq : 1) * (size_t)st->c->langid.dim;
    if (need <= st->rows_cap)
        return 0;
    size_t nc = st->rows_cap ? st->rows_cap : 4096;
    while (nc < need)
        nc *= 2;
    float *r = realloc(st->rows, sizeof(float) * nc), *d = r ? realloc(st->drows, sizeof(float) * nc) : NULL;
    if (r)
        st->rows = r;
    if (d)
        st->drows = d;
    if (!r || !d)
        return -1;
    st->rows_cap = nc;
    return 0;
}

int langid_next_batch(langid_state *st, int64_t step, int worker, int n_workers)
{
    const train_config *c = st->c;
    /* the batcher's order (data/batcher.c): one permutation per epoch, the
     * tasks taking turns along it in blocks of a batch, so N sync tasks of
     * batch b compute the step one task of batch N*b does */
    int64_t round = (int64_t)n_workers * c->batch_size, per_epoch = st->ds.train.n / round;
    if (per_epoch < 1)
        return -1;
    int64_t epoch = step / per_epoch, at = (step % per_epoch) * round + (int64_t)worker * c->batch_size;
    if (epoch != st->epoch) {
        int64_t cnt;
        if (idx_epoch_order(st->ds.train.n, c->seed, (uint64_t)epoch, 0, 1, st->order, &cnt) != 0)
            return -1;
        st->epoch = epoch;
    }
    if (batch_build(&st->b, &st->ds.train, st->order + at, c->batch_size) != 0 || rows_room(st) != 0)
        return -1;
    return 0;
}

int langid_forward_backward(langid_state *st, double *loss)
{
    const langid_model *lm = &st->c->langid;
    const int L = st->c->layout.n_layers, B = st->b.n;
    if (model_bag_forward(st->m, st->rows, st->b.n_uniq, lm->dim, st->b.idx, st->b.off, B, lm->mean, st->x) != 0 ||
        model_forward_range(st->m, 0, L - 1, st->params, st->x, B, NULL, st->logits) != 0 ||
        model_loss_head(st->m, st->logits, st->b.labels, B, st->dlogits, loss) != 0 ||
        model_backward_range(st->m, 0, L - 1, st->params, st->dlogits, B, st->dx, st->grads) != 0 ||
        model_bag_backward(st->m, st->dx, st->b.n_uniq, lm->dim, st->b.idx, st->b.off, B, lm->mean, st->drows) != 0)
        return -1;
    return 0;
}

/* Accuracy and mean loss on the test split, the rows from lookup. */
int langid_evaluate(langid_state *st, int (*lookup)(void *ctx, const int64_t *ids, int64_t n, float *out), void *ctx,
                    double *loss, double *acc)
{
    const train_config *c = st->c;
    const langid_split *t = &st->ds.test;
    const int L = c->layout.n_layers, C = c->layout.n_classes, D = c->langid.dim;
    double lsum = 0;
    int64_t right = 0;
    for (int64_t i0 = 0; i0 < t->n; i0 += c->batch_size) {
        int n = (int)(t->n - i0 < c->batch_size ? t->n - i0 : c->batch_size);
        for (int i = 0; i < n; i++)
            st->test_ex[i] = (uint32_t)(i0 + i);
        double l;
        if (batch_build(&st->b, t, st->test_ex, n) != 0 || rows_room(st) != 0 ||
            lookup(ctx, st->b.uniq, st->b.n_uniq, st->rows) != 0 ||
            model_bag_forward(st->m, st->rows, st->b.n_uniq, D, st->b.idx, st->b.off, n, c->langid.mean, st->x) != 0 ||
            model_forward_range(st->m, 0, L - 1, st->params, st->x, n, &(model_ctx){.inference = 1}, st->logits) != 0 ||
            model_loss_head(st->m, st->logits, st->b.labels, n, NULL, &l) != 0)
            return -1;
        lsum += l * n;
        for (int i = 0; i < n; i++) {
            const float *z = st->logits + (size_t)i * (size_t)C;
            int best = 0;
            for (int k = 1; k < C; k++)
                if (z[k] > z[best])
                    best = k;
            right += best == st->b.labels[i];
        }
    }
    *loss = lsum / (double)t->n;
    *acc = (double)right / (double)t->n;
    return 0;
}

int langid_export(langid_state *st, const char *path, const int64_t *ids, const float *values, int64_t n_rows,
                  int64_t step, char *err, size_t errlen)
{
    const train_config *c = st->c;
    const model_layout *ly = &c->layout;
    int nt = ly->n_tensors + 2;
    st_desc d[MODEL_MAX_TENSORS + 2];
    st_part parts[MODEL_MAX_TENSORS + 2];
    for (int k = 0; k < ly->n_tensors; k++) {
        d[k] = (st_desc){ly->tensors[k].name, "F32", &ly->tensors[k].shape};
        parts[k] = (st_part){st->params + ly->tensors[k].offset, ly->tensors[k].numel * sizeof(float)};
    }
    tensor_shape is = {.ndim = 1, .dims = {n_rows}}, vs = {.ndim = 2, .dims = {n_rows, c->langid.dim}};
    d[ly->n_tensors] = (st_desc){"emb:ids", "I64", &is};
    d[ly->n_tensors + 1] = (st_desc){"emb:values", "F32", &vs};
    parts[ly->n_tensors] = (st_part){ids, (size_t)n_rows * 8};
    parts[ly->n_tensors + 1] = (st_part){values, (size_t)n_rows * (size_t)c->langid.dim * sizeof(float)};
    char langs[512] = "", stp[32];
    for (int l = 0; l < st->ds.n_langs; l++)
        snprintf(langs + strlen(langs), sizeof(langs) - strlen(langs), "%s%s", l ? "," : "", st->ds.lang[l]);
    snprintf(stp, sizeof(stp), "%lld", (long long)step);
    const char *meta[] = {"format", "restps-model", "data", "langid", "model", c->langid.spec, "languages", langs,
                          "global_step", stp};
    return st_write_file_parts(path, d, nt, meta, 5, parts, nt, NULL, NULL, err, errlen);
}

/* ---- --local ---- */

static int local_lookup(void *ctx, const int64_t *ids, int64_t n, float *out)
{
    sparse_lookup(ctx, (const unsigned char *)ids, n, out);
    return 0;
}

int train_langid_local(const train_config *c)
{
    langid_state st;
    char err[512];
    sparse_table table;
    sparse_acc acc;
    sparse_acc_init(&acc, c->langid.dim);
    memset(&table, 0, sizeof(table));
    int rc = 1;
    if (langid_state_init(&st, c, c->batch_size, err, sizeof(err)) != 0 ||
        sparse_table_init(&table, "emb", &st.decl) != 0 || sparse_ensure_slots(&table, &c->optim) != 0 ||
        !(st.s0 = calloc(c->layout.n_params, sizeof(float))) || !(st.s1 = calloc(c->layout.n_params, sizeof(float)))) {
        fprintf(stderr, "workerd: %s\n", err[0] ? err : "out of memory");
        goto out;
    }
    printf("%s: langid: %d languages, %lld train / %lld test words, model %s; training locally (no ps), %s, batch "
           "%d, %lld steps; %s\n",
           c->name, st.ds.n_langs, (long long)st.ds.train.n, (long long)st.ds.test.n, c->langid.spec,
           optim_name(c->optim.kind), c->batch_size, (long long)c->train_steps, model_device_describe(c->threads));
    fflush(stdout);
    double t0 = clk_mono_secs(), touched = 0;
    for (int64_t step = 0; step < c->train_steps; step++) {
        double loss;
        if (langid_next_batch(&st, step, 0, 1) != 0) {
            fprintf(stderr, "workerd: langid: out of memory, or fewer train words than --batch_size\n");
            goto out;
        }
        sparse_lookup(&table, (const unsigned char *)st.b.uniq, st.b.n_uniq, st.rows);
        if (langid_forward_backward(&st, &loss) != 0) {
            fprintf(stderr, "workerd: forward/backward failed at step %lld\n", (long long)step);
            goto out;
        }
        for (int k = 0; k < c->layout.n_tensors; k++) {
            const model_tensor *t = &c->layout.tensors[k];
            optim_apply(&c->optim, st.params + t->offset, st.params + t->offset, st.grads + t->offset, 1.0f,
                        st.s0 + t->offset, st.s1 + t->offset, step + 1, step, t->numel);
        }
        acc.n = 0;
        if (acc.hash)
            memset(acc.hash, 0xff, sizeof(int64_t) * acc.hcap);
        if (sparse_acc_add(&acc, (const unsigned char *)st.b.uniq, st.drows, st.b.n_uniq) != 0 ||
            sparse_prepare(&table, &acc, err, sizeof(err)) != 0) {
            fprintf(stderr, "workerd: langid: %s\n", err[0] ? err : "out of memory");
            goto out;
        }
        sparse_apply(&table, &acc, &c->optim, 1.0f, step);
        touched += (double)st.b.n_uniq;
        if (c->log_every > 0 && (step + 1) % c->log_every == 0)
            printf("%s: step %lld loss %.4f rows touched %lld (%lld bytes each way; the dense table: %lld bytes)\n",
                   c->name, (long long)(step + 1), loss, (long long)st.b.n_uniq,
                   (long long)st.b.n_uniq * c->langid.dim * 4 + (long long)c->layout.n_params * 4,
                   (long long)(c->langid.rows * c->langid.dim * 4 + (int64_t)c->layout.n_params * 4));
    }
    double secs = clk_mono_secs() - t0, per = c->train_steps ? touched / (double)c->train_steps : 0;
    double sparse_b = per * c->langid.dim * 4 + (double)c->layout.n_params * 4;
    double dense_b = (double)c->langid.rows * c->langid.dim * 4 + (double)c->layout.n_params * 4;
    printf("%s: %lld steps in %.2f s: %.1f steps/s; rows touched per step %.1f of %lld: %.0f bytes per step each way "
           "against %.0f dense (%.0fx fewer); %lld rows held\n",
           c->name, (long long)c->train_steps, secs, (double)c->train_steps / secs, per, (long long)c->langid.rows,
           sparse_b, dense_b, dense_b / sparse_b, (long long)table.n);
    double tl, ta;
    if (langid_evaluate(&st, local_lookup, &table, &tl, &ta) != 0) {
        fprintf(stderr, "workerd: langid: evaluation failed\n");
        goto out;
    }
    printf("%s: test loss %.4f accuracy %.4f (%lld words)\n", c->name, tl, ta, (long long)st.ds.test.n);
    rc = 0;
    if (c->export_path) {
        int64_t *ids = malloc(sizeof(int64_t) * (size_t)(table.n ? table.n : 1));
        float *vals = malloc(sizeof(float) * (size_t)(table.n ? table.n : 1) * (size_t)c->langid.dim);
        int64_t k = 0;
        for (int64_t r = sparse_oldest(&table); ids && vals && r >= 0; r = sparse_newer(&table, r), k++) {
            ids[k] = table.ids[r];
            memcpy(vals + (size_t)k * (size_t)c->langid.dim, table.values + (size_t)r * (size_t)c->langid.dim,
                   sizeof(float) * (size_t)c->langid.dim);
        }
        if (!ids || !vals || langid_export(&st, c->export_path, ids, vals, table.n, c->train_steps, err, sizeof(err)) != 0) {
            fprintf(stderr, "workerd: --export=%s: %s\n", c->export_path, ids && vals ? err : "out of memory");
            rc = 1;
        } else {
            printf("%s: exported the model to %s\n", c->name, c->export_path);
        }
        free(ids);
        free(vals);
    }
out:
    sparse_acc_free(&acc);
    sparse_table_free(&table);
    langid_state_free(&st);
    return rc;
}
