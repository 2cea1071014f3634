/* langid_worker.c - --data=langid against the ps tasks: the chief declares
 * the embedding table on every ps task (PUT /v1/vars/emb/sparse: ps i holds
 * the ids with id % K == i), creates the dense layers and sends the
 * configuration (train_chief_setup); every worker pulls the dense layers
 * (async, or the sync long poll), the rows its batch touches from the ps
 * task of each (POST /v1/vars/emb/rows), and pushes the dense gradients with
 * the rows' gradients in one POST /v1/grads body per ps (emb:ids,
 * emb:values), so that a sync step sums them by id over the workers. The
 * chief reports the test accuracy (the test words' rows read the same way)
 * and exports the dense layers with the rows of every id the data uses.
 * Not here: the evaluator, the ring, the pipeline (workerd.c refuses them),
 * stale-synchronous bounds and a ps's restart (the chief's put-back is for
 * dense variables). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "workerd/langid_train.h"

#define EMB "emb"

typedef struct lworker {
    const train_config *c;
    langid_state st;
    ps_client *pc;
    shards sh;
    int K, sync;
    /* per ps: the batch's ids there, where each goes in st.rows, their gradients */
    int64_t **ids;
    int64_t **pos;
    float **vals;
    int64_t *n;
    int64_t cap;
    unsigned char *rx; /* a rows answer lands here */
    size_t rx_cap;
    double pulled, pushed; /* bytes of rows, over the run */
    int64_t steps;
} lworker;

static int room(lworker *w, int64_t need)
{
    if (need <= w->cap)
        return 0;
    int64_t nc = w->cap ? w->cap : 4096;
    while (nc < need)
        nc *= 2;
    const size_t D = (size_t)w->c->langid.dim;
    for (int i = 0; i < w->K; i++) {
        int64_t *a = realloc(w->ids[i], sizeof(int64_t) * (size_t)nc);
        if (a)
            w->ids[i] = a;
        int64_t *p = realloc(w->pos[i], sizeof(int64_t) * (size_t)nc);
        if (p)
            w->pos[i] = p;
        float *v = realloc(w->vals[i], sizeof(float) * (size_t)nc * D);
        if (v)
            w->vals[i] = v;
        if (!a || !p || !v)
            return -1;
    }
    size_t rc = 4096 + (size_t)nc * D * 4;
    unsigned char *r = realloc(w->rx, rc);
    if (!r)
        return -1;
    w->rx = r;
    w->rx_cap = rc;
    w->cap = nc;
    return 0;
}

/* The rows of ids[0..n) into out, each from its ps (id % K). */
static int pull_rows(void *ctx, const int64_t *ids, int64_t n, float *out)
{
    lworker *w = ctx;
    const size_t D = (size_t)w->c->langid.dim;
    if (room(w, n) != 0)
        return -1;
    for (int i = 0; i < w->K; i++)
        w->n[i] = 0;
    for (int64_t j = 0; j < n; j++) {
        int i = (int)(ids[j] % w->K);
        w->ids[i][w->n[i]] = ids[j];
        w->pos[i][w->n[i]++] = j;
    }
    for (int i = 0; i < w->K; i++) {
        if (w->n[i] == 0)
            continue;
        if (ps_pull_rows(w->pc, i, EMB, w->ids[i], w->n[i], (int)D, w->vals[i], w->rx, w->rx_cap, NULL) != PS_OK) {
            fprintf(stderr, "workerd: %s: pulling rows: %s\n", w->c->name, ps_error(w->pc));
            return -1;
        }
        for (int64_t k = 0; k < w->n[i]; k++)
            memcpy(out + (size_t)w->pos[i][k] * D, w->vals[i] + (size_t)k * D, sizeof(float) * D);
        w->pulled += (double)w->n[i] * (double)D * 4;
    }
    return 0;
}

/* The chief: the table on every ps task before the configuration. */
static int declare(lworker *w)
{
    const train_config *c = w->c;
    train_wait_for_all(c, w->pc, "/healthz", "the ps tasks");
    for (int i = 0; i < w->K; i++) {
        const sparse_decl *d = &w->st.decl;
        json_t *j = json_pack("{s:I,s:i,s:I,s:s,s:f,s:I,s:i,s:i}", "rows", (json_int_t)d->rows, "dim", d->dim,
                              "max_rows", (json_int_t)d->max_rows, "init", "uniform", "init_scale",
                              (double)d->init_scale, "seed", (json_int_t)(d->seed & ((1ull << 53) - 1)), "shard", i,
                              "shards", w->K);
        int rc = ps_json(w->pc, i, "PUT", "/v1/vars/" EMB "/sparse", j, 1, NULL);
        json_decref(j);
        if (rc != PS_OK) {
            fprintf(stderr, "workerd: %s: declaring the embedding table on ps %d: %s\n", c->name, i, ps_error(w->pc));
            return -1;
        }
    }
    printf("%s: the embedding table %s [%lld, %d] on %d ps task%s (ps i holds the ids with id %% %d == i)\n", c->name,
           EMB, (long long)c->langid.rows, c->langid.dim, w->K, w->K > 1 ? "s" : "", w->K);
    return 0;
}

/* One step: pull, compute, push. 1 when training is over, -1 on failure. */
static int step(lworker *w, int64_t k)
{
    const train_config *c = w->c;
    langid_state *st = &w->st;
    int64_t gs;
    int behind = 0, prc;
    if (w->sync)
        prc = shards_pull_sync(&w->sh, st->params, c->trainer, 30000, c->train_steps, &gs, &behind);
    else
        prc = shards_pull(&w->sh, st->params, -1, 0, &gs);
    if (prc != PS_OK) {
        fprintf(stderr, "workerd: %s: pulling: %s\n", c->name, ps_error(w->pc));
        return -1;
    }
    if (gs >= c->train_steps)
        return 1;
    /* sync: the batch of the step (every worker its block); async: this task's k-th */
    if (langid_next_batch(st, w->sync ? gs : k, c->trainer, c->n_trainers) != 0 ||
        pull_rows(w, st->b.uniq, st->b.n_uniq, st->rows) != 0)
        return -1;
    double loss;
    if (langid_forward_backward(st, &loss) != 0) {
        fprintf(stderr, "workerd: %s: forward/backward failed\n", c->name);
        return -1;
    }
    /* the rows' gradients, to the ps task of each (pull_rows grouped the ids) */
    const size_t D = (size_t)c->langid.dim;
    shard_extra extra[w->K];
    st_desc d[w->K][2];
    tensor_shape is[w->K], vs[w->K];
    const void *data[w->K][2];
    for (int i = 0; i < w->K; i++) {
        for (int64_t j = 0; j < w->n[i]; j++)
            memcpy(w->vals[i] + (size_t)j * D, st->drows + (size_t)w->pos[i][j] * D, sizeof(float) * D);
        is[i] = (tensor_shape){.ndim = 1, .dims = {w->n[i]}};
        vs[i] = (tensor_shape){.ndim = 2, .dims = {w->n[i], (int64_t)D}};
        d[i][0] = (st_desc){EMB ":ids", "I64", &is[i]};
        d[i][1] = (st_desc){EMB ":values", "F32", &vs[i]};
        data[i][0] = w->ids[i];
        data[i][1] = w->vals[i];
        extra[i] = (shard_extra){w->n[i] ? 2 : 0, d[i], data[i]};
        w->pushed += (double)w->n[i] * (double)(D * 4 + 8);
    }
    push_meta pm = {.worker = c->trainer, .loss = loss, .batch_size = c->batch_size, .clock = -1};
    int64_t after;
    int outcome;
    if ((prc = shards_push_extra(&w->sh, st->grads, &pm, extra, &after, &outcome)) != PS_OK) {
        if (prc == PS_EHTTP && ps_http_status(w->pc) == 409) { /* sync: a step the ps has not reached */
            shards_rewind(&w->sh);
            return 0;
        }
        fprintf(stderr, "workerd: %s: pushing: %s\n", c->name, ps_error(w->pc));
        return -1;
    }
    w->steps++;
    if (c->log_every > 0 && (k + 1) % c->log_every == 0)
        printf("%s: step %lld (global step %lld) loss %.4f rows %lld: %.0f bytes pulled and %.0f pushed per step "
               "(rows), %zu (dense)\n",
               c->name, (long long)(k + 1), (long long)after, loss, (long long)st->b.n_uniq,
               w->pulled / (double)w->steps, w->pushed / (double)w->steps, c->layout.n_params * 4);
    return 0;
}

static int cmp_id(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The chief at the end: the test accuracy, the export (the rows of every
 * id the data uses), the ps tasks stopped. */
static int chief_end(lworker *w)
{
    const train_config *c = w->c;
    langid_state *st = &w->st;
    int64_t gs;
    char err[512];
    if (shards_pull(&w->sh, st->params, -1, 0, &gs) != PS_OK) {
        fprintf(stderr, "workerd: %s: the final pull: %s\n", c->name, ps_error(w->pc));
        return 1;
    }
    double tl, ta;
    if (langid_evaluate(st, pull_rows, w, &tl, &ta) != 0)
        return 1;
    printf("%s: global step %lld: test loss %.4f accuracy %.4f (%lld words)\n", c->name, (long long)gs, tl, ta,
           (long long)st->ds.test.n);
    int rc = 0;
    if (c->export_path) {
        /* every id of the data, once */
        const langid_split *sp[2] = {&st->ds.train, &st->ds.test};
        int64_t total = sp[0]->off[sp[0]->n] + sp[1]->off[sp[1]->n];
        int64_t *ids = malloc(sizeof(int64_t) * (size_t)(total ? total : 1)), n = 0;
        for (int s = 0; ids && s < 2; s++)
            memcpy(ids + n, sp[s]->ids, sizeof(int64_t) * (size_t)sp[s]->off[sp[s]->n]), n += sp[s]->off[sp[s]->n];
        int64_t u = 0;
        if (ids) { /* sort and drop duplicates */
            qsort(ids, (size_t)n, sizeof(int64_t), cmp_id);
            for (int64_t i = 0; i < n; i++)
                if (i == 0 || ids[i] != ids[i - 1])
                    ids[u++] = ids[i];
        }
        float *vals = ids ? malloc(sizeof(float) * (size_t)(u ? u : 1) * (size_t)c->langid.dim) : NULL;
        int ok = vals != NULL;
        for (int64_t at = 0; ok && at < u; at += 65536)
            ok = pull_rows(w, ids + at, u - at < 65536 ? u - at : 65536, vals + (size_t)at * (size_t)c->langid.dim) == 0;
        if (!ok || langid_export(st, c->export_path, ids, vals, u, gs, err, sizeof(err)) != 0) {
            fprintf(stderr, "workerd: --export=%s: %s\n", c->export_path, ok ? err : "out of memory or a failed pull");
            rc = 1;
        } else {
            printf("%s: exported the model to %s (%lld rows)\n", c->name, c->export_path, (long long)u);
        }
        free(ids);
        free(vals);
    }
    return rc;
}

int train_langid_worker(const train_config *c)
{
    lworker w;
    memset(&w, 0, sizeof(w));
    w.c = c;
    w.sync = c->sync;
    char err[512] = "";
    int rc = 1;
    if (langid_state_init(&w.st, c, c->batch_size, err, sizeof(err)) != 0 ||
        !(w.pc = train_connect_ps(c, c->timeout_ms)) ||
        shards_init(&w.sh, w.pc, &c->layout, c->placement, c->partition_bytes, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err[0] ? err : "out of memory");
        goto out;
    }
    w.K = ps_shards(w.pc);
    w.ids = calloc((size_t)w.K, sizeof(int64_t *));
    w.pos = calloc((size_t)w.K, sizeof(int64_t *));
    w.vals = calloc((size_t)w.K, sizeof(float *));
    w.n = calloc((size_t)w.K, sizeof(int64_t));
    if (!w.ids || !w.pos || !w.vals || !w.n)
        goto out;
    if (w.sync)
        for (int i = 0; i < w.K; i++)
            if (w.sh.s[i].n_p == 0) {
                fprintf(stderr, "workerd: --data=langid --sync: ps %d holds no dense variable (%d ps tasks, %d dense "
                                "variables): its rows would be read before its step; use fewer ps tasks\n",
                        i, w.K, c->layout.n_tensors);
                rc = 2;
                goto out;
            }
    if (c->is_chief) {
        if (declare(&w) != 0)
            goto out;
        int cr = train_chief_setup(c, w.pc, &w.sh, w.st.params);
        if (cr != 0) {
            rc = cr;
            goto out;
        }
    } else {
        train_wait_for_all(c, w.pc, "/readyz", "the chief to initialize the variables");
        if (train_check_placement(c, w.pc, &w.sh) != 0) {
            rc = 2;
            goto out;
        }
        json_t *cfg = NULL; /* the chief's configuration decides the mode */
        if (ps_json(w.pc, 0, "GET", "/v1/config", NULL, 1, &cfg) == PS_OK && json_is_boolean(json_object_get(cfg, "sync")))
            w.sync = json_is_true(json_object_get(cfg, "sync"));
        json_decref(cfg);
    }
    printf("%s: langid: %d languages, %lld train / %lld test words, model %s, %s, batch %d, %lld steps\n", c->name,
           w.st.ds.n_langs, (long long)w.st.ds.train.n, (long long)w.st.ds.test.n, c->langid.spec,
           w.sync ? "sync" : "async", c->batch_size, (long long)c->train_steps);
    fflush(stdout);
    double t0 = clk_mono_secs();
    int64_t k = 0;
    for (;; k++) {
        int s = step(&w, k);
        if (s < 0)
            goto out;
        if (s > 0 || train_stop_requested())
            break;
    }
    double secs = clk_mono_secs() - t0;
    double dense = (double)c->langid.rows * c->langid.dim * 4;
    printf("%s: %lld steps in %.2f s; rows per step: %.0f bytes pulled, %.0f pushed, against %.0f for the whole table "
           "(%.0fx fewer); dense layers %zu bytes each way\n",
           c->name, (long long)w.steps, secs, w.steps ? w.pulled / (double)w.steps : 0,
           w.steps ? w.pushed / (double)w.steps : 0, dense,
           w.steps && w.pulled > 0 ? dense / (w.pulled / (double)w.steps) : 0, c->layout.n_params * 4);
    json_t *done = json_pack("{s:i}", "worker", c->trainer);
    for (int i = 0; i < w.K; i++)
        ps_json(w.pc, i, "POST", "/v1/done", done, 1, NULL);
    json_decref(done);
    rc = 0;
    if (c->is_chief) {
        train_chief_wait_others(c, w.pc);
        rc = chief_end(&w);
        train_chief_stop_ps(c, w.pc);
    }
out:
    for (int i = 0; w.ids && i < w.K; i++) {
        free(w.ids[i]);
        free(w.pos[i]);
        free(w.vals[i]);
    }
    free(w.ids);
    free(w.pos);
    free(w.vals);
    free(w.n);
    free(w.rx);
    if (w.pc)
        shards_free(&w.sh);
    ps_client_free(w.pc);
    langid_state_free(&w.st);
    return rc;
}
