/* evaluator.c - the evaluations: --evaluate_model=FILE (the model rebuilt from the file's metadata alone),
 * and the evaluator task, which evaluates what the ps hold every --eval_secs
 * and reports to ps 0. */
#include "workerd/train.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"
#include "shards/shards.h"

int train_evaluate_file(const train_config *c, const char *path)
{
    char err[512];
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        fprintf(stderr, "workerd: --evaluate_model=%s: %s\n", path, strerror(errno));
        return 2;
    }
    unsigned char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            cap = cap ? 2 * cap : (size_t)1 << 20;
            unsigned char *nb = realloc(buf, cap);
            if (!nb) {
                fclose(fp);
                free(buf);
                fprintf(stderr, "workerd: --evaluate_model=%s: out of memory\n", path);
                return 1;
            }
            buf = nb;
        }
        size_t got = fread(buf + len, 1, cap - len, fp);
        len += got;
        if (got == 0)
            break;
    }
    fclose(fp);
    st_file f;
    memset(&f, 0, sizeof(f));
    int rc = 2;
    model *m = NULL;
    float *params = NULL;
    idx_dataset ds;
    int have_ds = 0;
    train_config cc = *c;
    if (st_parse(buf, len, &f, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: --evaluate_model=%s: not a safetensors file: %s\n", path, err);
        goto out;
    }
    const char *spec = st_meta_get(&f, "model"), *shape_s = st_meta_get(&f, "input_shape");
    model_shape shape;
    if (!spec || !shape_s) {
        fprintf(stderr, "workerd: --evaluate_model=%s: the file has no model and input_shape in its "
                        "__metadata__ (exported by an older workerd?): cannot rebuild the model\n",
                path);
        goto out;
    }
    if (model_shape_parse(shape_s, &shape) != 0) {
        fprintf(stderr, "workerd: --evaluate_model=%s: input_shape \"%.64s\" is not H,W,C\n", path, shape_s);
        goto out;
    }
    if (model_layout_init(&cc.layout, spec, shape, IDX_N_CLASSES, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: --evaluate_model=%s: %s\n", path, err);
        goto out;
    }
    m = model_new(model_device_backend(), &cc.layout, 1000, err, sizeof(err));
    params = model_host_alloc(m, cc.layout.n_params * sizeof(float));
    if (!m || !params) {
        fprintf(stderr, "workerd: %s\n", m ? "out of memory" : err);
        rc = 1;
        goto out;
    }
    for (int t = 0; t < cc.layout.n_tensors; t++) {
        const model_tensor *mt = &cc.layout.tensors[t];
        int i = st_find(&f, mt->name);
        if (i < 0 || strcmp(f.tensors[i].dtype, "F32") != 0 ||
            !tensor_shape_equal(&f.tensors[i].shape, &mt->shape)) {
            fprintf(stderr, "workerd: --evaluate_model=%s: tensor %s is missing or not F32 of the shape %s gives it\n",
                    path, mt->name, cc.layout.spec);
            goto out;
        }
        memcpy(params + mt->offset, buf + f.data_start + f.tensors[i].begin, mt->numel * sizeof(float));
    }
    cc.n_trainers = 1;
    if ((rc = train_load(&cc, &ds)) != 0)
        goto out;
    have_ds = 1;
    double loss, acc;
    if (model_evaluate(m, params, ds.test.images, ds.test.labels, ds.test.n, &loss, &acc) != 0) {
        fprintf(stderr, "workerd: the evaluation failed\n");
        rc = 1;
        goto out;
    }
    const char *gs = st_meta_get(&f, "global_step");
    printf("%s: %s (model %s, global step %s): test loss %.4f, test accuracy %.4f on %lld examples\n",
           c->name, path, cc.layout.spec, gs ? gs : "?", loss, acc, (long long)ds.test.n);
    fflush(stdout);
    rc = 0;
out:
    if (have_ds)
        idx_dataset_free(&ds);
    model_host_free(m, params);
    model_free(m);
    st_file_free(&f);
    free(buf);
    return rc;
}

int train_evaluator(const train_config *c)
{
    idx_dataset ds;
    int rc = train_load(c, &ds);
    if (rc)
        return rc;
    char err[512];
    model *m = model_new(model_device_backend(), &c->layout, 1000, err, sizeof(err));
    float *params = model_host_alloc(m, c->layout.n_params * sizeof(float));
    ps_client *pc = train_connect_ps(c, c->timeout_ms);
    shards sh = {0};
    rc = 1;
    if (!m || !params || !pc ||
        shards_init(&sh, pc, &c->layout, c->placement, c->partition_bytes, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", m ? "out of memory" : err);
        goto out;
    }
    train_wait_for_all(c, pc, "/readyz", "the chief to initialize the variables");
    if (train_check_placement(c, pc, &sh) != 0) {
        rc = 2;
        goto out;
    }
    /* the evaluator is not part of training: it rides through a short ps
     * restart, but does not outlive a job that ended by much */
    double budget = c->eval_secs * 2 > 10 ? c->eval_secs * 2 : 10;
    ps_set_retry_ms(pc, (long)((budget < c->retry_secs ? budget : c->retry_secs) * 1000));
    /* as variables_to_restore(): the moving averages when the chief keeps them */
    ps_set_moving_average(pc, c->moving_average_decay > 0);
    if (c->moving_average_decay > 0)
        printf("%s: evaluating the moving averages (--moving_average_decay=%g)\n", c->name,
               (double)c->moving_average_decay);
    int64_t last = -1;
    for (;;) {
        int64_t step;
        if (shards_pull(&sh, params, -1, 0, &step) != PS_OK) {
            if (ps_http_status(pc) == 0 && last >= 0) {
                printf("%s: the ps stopped; last evaluated global step %lld\n", c->name, (long long)last);
                rc = 0;
            } else {
                fprintf(stderr, "workerd: pull: %s\n", ps_error(pc));
            }
            goto out;
        }
        if (step != last) {
            double loss, acc;
            if (model_evaluate(m, params, ds.test.images, ds.test.labels, ds.test.n, &loss, &acc) != 0) {
                fprintf(stderr, "workerd: evaluation failed at global step %lld\n", (long long)step);
                goto out;
            }
            printf("%s: global step %lld: test loss %.4f, test accuracy %.4f\n", c->name,
                   (long long)step, loss, acc);
            fflush(stdout);
            json_t *rep = json_pack("{s:I,s:f,s:f,s:I}", "global_step", (json_int_t)step, "loss",
                                    loss, "accuracy", acc, "examples", (json_int_t)ds.test.n);
            if (ps_json(pc, 0, "POST", "/v1/eval", rep, 1, NULL) != PS_OK)
                fprintf(stderr, "workerd: eval report: %s\n", ps_error(pc));
            json_decref(rep);
            last = step;
        }
        if (step >= c->train_steps) {
            rc = 0;
            goto out;
        }
        train_sleep(c->eval_secs);
        if (train_stop_requested()) {
            printf("%s: stopped by a signal; last evaluated global step %lld\n", c->name,
                   (long long)last);
            rc = 0;
            goto out;
        }
    }
out:
    shards_free(&sh);
    ps_client_free(pc);
    model_host_free(m, params); /* before model_free */
    model_free(m);
    idx_dataset_free(&ds);
    return rc;
}

