/* evaluator.c - the evaluations: --evaluate_model=FILE (the model rebuilt from the file's metadata alone;
 * --evaluate_logits writes its logits, --convert_model=FILE turns it into ONNX),
 * and the evaluator task, which evaluates what the ps hold every --eval_secs
 * and reports to ps 0. */
#include "workerd/train.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "clock.h"
#include "onnx/onnx_export.h"
#include "safetensors.h"
#include "shards/shards.h"

/* The largest header a model file can have: the model's tensors (at most
 * MODEL_MAX_TENSORS), a checkpoint's slots and moving averages beside them,
 * and the metadata (the spec; a psd checkpoint's config, variables and
 * checksums) take tens of KiB. */
#define MODEL_FILE_HEADER_MAX ((uint64_t)1 << 20)

/* Open path, a regular file (opened without blocking: a FIFO or a device is
 * refused, not waited on), and read its prefix and header into *f, checked
 * against the file's size and MODEL_FILE_HEADER_MAX before the header is read.
 * No data is read. 0 with *fd, or the exit status (2 a bad file, 1 out of
 * memory) with the message printed. */
static int open_model_file(const char *flag, const char *path, int *fdp, st_file *f)
{
    char why[300];
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        fprintf(stderr, "workerd: --%s=%s: %s\n", flag, path, strerror(errno));
        return 2;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        fprintf(stderr, "workerd: --%s=%s: %s\n", flag, path, strerror(errno));
        close(fd);
        return 2;
    }
    if (!S_ISREG(st.st_mode)) {
        fprintf(stderr, "workerd: --%s=%s: not a regular file (%s)\n", flag, path,
                S_ISDIR(st.st_mode) ? "a folder" : S_ISFIFO(st.st_mode) ? "a fifo"
                : S_ISSOCK(st.st_mode) ? "a socket" : "a device");
        close(fd);
        return 2;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    uint64_t size = (uint64_t)st.st_size, hl = 0;
    unsigned char prefix[8] = {0};
    if (size >= 8 && st_pread_all(fd, prefix, 8, 0, NULL, 0) != 0) {
        fprintf(stderr, "workerd: --%s=%s: %s\n", flag, path, strerror(errno));
        close(fd);
        return 2;
    }
    if (st_read_prefix(prefix, size, &hl, why, sizeof(why)) != 0) {
        fprintf(stderr, "workerd: --%s=%s: not a safetensors file: %s\n", flag, path, why);
        close(fd);
        return 2;
    }
    if (hl > MODEL_FILE_HEADER_MAX) {
        fprintf(stderr, "workerd: --%s=%s: a header of %llu bytes (a model file's is at most %llu; "
                        "file is %llu bytes)\n",
                flag, path, (unsigned long long)hl, (unsigned long long)MODEL_FILE_HEADER_MAX,
                (unsigned long long)size);
        close(fd);
        return 2;
    }
    unsigned char *head = malloc((size_t)hl);
    if (!head) {
        fprintf(stderr, "workerd: --%s=%s: out of memory for a header of %llu bytes\n", flag, path,
                (unsigned long long)hl);
        close(fd);
        return 1;
    }
    if (st_pread_all(fd, head, (size_t)hl, 8, NULL, 0) != 0) {
        fprintf(stderr, "workerd: --%s=%s: %s\n", flag, path, strerror(errno));
        free(head);
        close(fd);
        return 2;
    }
    int pr = st_parse_header(head, hl, size - 8 - hl, f, why, sizeof(why));
    free(head);
    if (pr != 0) {
        fprintf(stderr, "workerd: --%s=%s: %s%s\n", flag, path,
                pr == ST_ENOMEM ? "" : "not a safetensors file: ", why);
        close(fd);
        return pr == ST_ENOMEM ? 1 : 2;
    }
    *fdp = fd;
    return 0;
}

/* Whether name is "<L's tensor t>:<slot>" (a checkpoint's optimizer slot or
 * moving average of that variable); t, or -1. */
static int slot_of(const model_layout *L, const char *name)
{
    const char *colon = strchr(name, ':');
    if (!colon || !colon[1])
        return -1;
    for (int t = 0; t < L->n_tensors; t++) {
        size_t n = strlen(L->tensors[t].name);
        if ((size_t)(colon - name) == n && strncmp(name, L->tensors[t].name, n) == 0)
            return t;
    }
    return -1;
}

/* That f's tensors are exactly L's: each of L's by name, F32, of its shape
 * and size; beside them only what a checkpoint keeps per variable (a
 * "<name>:<slot>" tensor, F32 of the variable's shape), which is not read.
 * 0, or -1 with err naming the first tensor that is wrong. */
static int check_tensors(const st_file *f, const model_layout *L, char *err, size_t errlen)
{
    char have[160], want[160];
    for (int t = 0; t < L->n_tensors; t++) {
        const model_tensor *mt = &L->tensors[t];
        int i = st_find(f, mt->name);
        if (i < 0) {
            snprintf(err, errlen, "tensor %s is missing (model %s has it)", mt->name, L->spec);
            return -1;
        }
        const st_tensor *ft = &f->tensors[i];
        if (strcmp(ft->dtype, "F32") != 0) {
            snprintf(err, errlen, "tensor %s is %s; the model's tensors are F32", mt->name, ft->dtype);
            return -1;
        }
        if (!tensor_shape_equal(&ft->shape, &mt->shape)) {
            tensor_shape_format(&ft->shape, have, sizeof(have));
            tensor_shape_format(&mt->shape, want, sizeof(want));
            snprintf(err, errlen, "tensor %s has shape [%s]; model %s gives it [%s]", mt->name, have, L->spec,
                     want);
            return -1;
        }
        if (ft->end - ft->begin != (uint64_t)mt->numel * sizeof(float)) {
            snprintf(err, errlen, "tensor %s holds %llu bytes; its shape takes %llu", mt->name,
                     (unsigned long long)(ft->end - ft->begin), (unsigned long long)mt->numel * sizeof(float));
            return -1;
        }
    }
    for (int i = 0; i < f->n_tensors; i++) {
        const st_tensor *ft = &f->tensors[i];
        if (model_layout_find(L, ft->name) >= 0)
            continue;
        int t = slot_of(L, ft->name);
        if (t < 0) {
            snprintf(err, errlen, "tensor %.64s is not one of model %s's (nor a checkpoint's slot of one)",
                     ft->name, L->spec);
            return -1;
        }
        if (strcmp(ft->dtype, "F32") != 0 || !tensor_shape_equal(&ft->shape, &L->tensors[t].shape)) {
            snprintf(err, errlen, "tensor %.64s is not F32 of the shape of %s", ft->name, L->tensors[t].name);
            return -1;
        }
    }
    return 0;
}

/* A model file as --evaluate_model and --convert_model read it: its model
 * from its metadata alone (into *L), its tensors checked to be exactly the
 * model's, then only their data, each straight into its place in *params
 * (malloc'ed, L->n_params floats). f keeps the header (its metadata). 0, or
 * the exit status (2 a bad file, 1 out of memory) with the message printed. */
static int load_model_file(const char *flag, const char *path, model_layout *L, float **params, st_file *f)
{
    char err[1280]; /* a tensor's name and two shapes beside a spec of MODEL_SPEC_MAX */
    memset(f, 0, sizeof(*f));
    *params = NULL;
    int fd = -1;
    int rc = open_model_file(flag, path, &fd, f);
    if (rc != 0)
        return rc;
    rc = 2;
    const char *spec = st_meta_get(f, "model"), *shape_s = st_meta_get(f, "input_shape");
    model_shape shape;
    const char *data = st_meta_get(f, "data");
    if (data && strcmp(data, "langid") == 0) {
        fprintf(stderr, "workerd: --%s=%s: a --data=langid model (%.200s): --evaluate_model and --convert_model "
                        "read Fashion-MNIST models; the run that trained it printed its test accuracy\n",
                flag, path, spec ? spec : "embed");
        goto out;
    }
    if (!spec || !shape_s) {
        fprintf(stderr, "workerd: --%s=%s: the file has no model and input_shape in its "
                        "__metadata__ (exported by an older workerd?): cannot rebuild the model\n",
                flag, path);
        goto out;
    }
    if (model_shape_parse(shape_s, &shape) != 0) {
        fprintf(stderr, "workerd: --%s=%s: input_shape \"%.64s\" is not H,W,C\n", flag, path, shape_s);
        goto out;
    }
    if (model_layout_init(L, spec, shape, IDX_N_CLASSES, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: --%s=%s: %s\n", flag, path, err);
        goto out;
    }
    /* the tensors against the layout before the model's workspace and
     * buffers are made: their sizes are the spec's, and the spec is the file's */
    if (check_tensors(f, L, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: --%s=%s: %s\n", flag, path, err);
        goto out;
    }
    *params = malloc(L->n_params * sizeof(float));
    if (!*params) {
        fprintf(stderr, "workerd: out of memory\n");
        rc = 1;
        goto out;
    }
    for (int t = 0; t < L->n_tensors; t++) {
        const model_tensor *mt = &L->tensors[t];
        const st_tensor *ft = &f->tensors[st_find(f, mt->name)];
        if (st_pread_all(fd, *params + mt->offset, mt->numel * sizeof(float), f->data_start + ft->begin, NULL,
                         0) != 0) {
            fprintf(stderr, "workerd: --%s=%s: reading tensor %s: %s\n", flag, path, mt->name, strerror(errno));
            goto out;
        }
    }
    rc = 0;
out:
    close(fd);
    if (rc != 0) {
        free(*params);
        *params = NULL;
        st_file_free(f);
    }
    return rc;
}

/* --evaluate_logits=FILE: the logits of the n test examples (no dropout), in
 * batches of m's max_batch, and their labels, as a safetensors file. 0 or -1. */
static int write_logits(const train_config *c, model *m, const float *params, const idx_split *test)
{
    const model_layout *L = &c->layout;
    int nc = L->n_classes, mb = m->max_batch;
    float *logits = malloc((size_t)test->n * nc * sizeof(float));
    if (!logits) {
        fprintf(stderr, "workerd: --evaluate_logits: out of memory\n");
        return -1;
    }
    model_ctx ctx = {0};
    ctx.inference = 1;
    for (int64_t i = 0; i < test->n; i += mb) {
        int b = test->n - i < mb ? (int)(test->n - i) : mb;
        if (model_forward_range(m, 0, L->n_layers - 1, params, test->images + (size_t)i * L->n_in, b, &ctx,
                                logits + (size_t)i * nc) != 0) {
            fprintf(stderr, "workerd: --evaluate_logits: the forward pass failed\n");
            free(logits);
            return -1;
        }
    }
    tensor_shape ls = {2, {test->n, nc}}, ys = {1, {test->n}};
    st_desc d[2] = {{"labels", "U8", &ys}, {"logits", "F32", &ls}};
    size_t lb = (size_t)test->n * nc * sizeof(float);
    unsigned char *data = malloc(lb + (size_t)test->n);
    char err[512];
    int rc = -1;
    if (data) {
        /* safetensors' data in the header's order: labels first, then logits */
        memcpy(data, test->labels, (size_t)test->n);
        memcpy(data + test->n, logits, lb);
        const char *meta[] = {"model", L->spec};
        rc = st_write_file(c->logits_path, d, 2, meta, 1, data, lb + (size_t)test->n, err, sizeof(err));
        if (rc != 0)
            fprintf(stderr, "workerd: --evaluate_logits: %s\n", err);
    }
    free(data);
    free(logits);
    return rc == 0 ? 0 : -1;
}

int train_evaluate_file(const train_config *c, const char *path)
{
    char err[512];
    st_file f;
    train_config cc = *c;
    float *params = NULL;
    int rc = load_model_file("evaluate_model", path, &cc.layout, &params, &f);
    if (rc != 0)
        return rc;
    model *m = model_new(model_device_backend(), &cc.layout, 1000, err, sizeof(err));
    idx_dataset ds;
    int have_ds = 0;
    if (!m) {
        fprintf(stderr, "workerd: %s\n", err);
        rc = 1;
        goto out;
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
    if (c->logits_path && write_logits(&cc, m, params, &ds.test) != 0)
        rc = 1;
    /* --export_onnx beside it: the file converted too (as --convert_model) */
    const char *decay = st_meta_get(&f, "moving_average_decay");
    onnx_export_meta meta = {gs ? strtoll(gs, NULL, 10) : -1, decay ? strtof(decay, NULL) : 0, NULL};
    if (c->onnx_path && onnx_export_write(&cc.layout, params, &meta, c->onnx_path, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: --export_onnx: %s\n", err);
        rc = 1;
    }
out:
    if (have_ds)
        idx_dataset_free(&ds);
    free(params);
    model_free(m);
    st_file_free(&f);
    return rc;
}

int train_convert_file(const train_config *c, const char *path, const char *onnx_path)
{
    char err[512];
    st_file f;
    model_layout *L = malloc(sizeof(*L));
    float *params = NULL;
    if (!L) {
        fprintf(stderr, "workerd: out of memory\n");
        return 1;
    }
    int rc = load_model_file("convert_model", path, L, &params, &f);
    if (rc != 0) {
        free(L);
        return rc;
    }
    const char *gs = st_meta_get(&f, "global_step"), *decay = st_meta_get(&f, "moving_average_decay");
    onnx_export_meta meta = {gs ? strtoll(gs, NULL, 10) : -1, decay ? strtof(decay, NULL) : 0, NULL};
    if (onnx_export_write(L, params, &meta, onnx_path, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: --convert_model=%s: %s\n", path, err);
        rc = 1;
    } else {
        printf("%s: %s (model %s, global step %s) as ONNX (opset %d) in %s\n", c->name, path, L->spec,
               gs ? gs : "?", ONNX_EXPORT_OPSET, onnx_path);
    }
    free(params);
    free(L);
    st_file_free(&f);
    return rc;
}

/* The evaluator's one evaluation of the parameters of global step step:
 * printed and reported to ps 0 (POST /v1/eval). 0, or -1. */
static int evaluate_and_report(const train_config *c, ps_client *pc, model *m, const float *params,
                               const idx_dataset *ds, int64_t step)
{
    double loss, acc;
    if (model_evaluate(m, params, ds->test.images, ds->test.labels, ds->test.n, &loss, &acc) != 0) {
        fprintf(stderr, "workerd: evaluation failed at global step %lld\n", (long long)step);
        return -1;
    }
    printf("%s: global step %lld: test loss %.4f, test accuracy %.4f\n", c->name, (long long)step, loss, acc);
    fflush(stdout);
    json_t *rep = json_pack("{s:I,s:f,s:f,s:I}", "global_step", (json_int_t)step, "loss", loss, "accuracy", acc,
                            "examples", (json_int_t)ds->test.n);
    if (ps_json(pc, 0, "POST", "/v1/eval", rep, 1, NULL) != PS_OK)
        fprintf(stderr, "workerd: eval report: %s\n", ps_error(pc));
    json_decref(rep);
    return 0;
}

/* Between two evaluations: until --eval_secs after the last one began, or
 * sooner once ps 0's global step reaches --train_steps, so that the final
 * model is evaluated (and reported) at once, while the chief waits for it
 * before it stops the ps tasks. ps 0's step is read every second at most
 * (GET /v1/status). 1 when training reached --train_steps, 0 when the time
 * is up or a signal came, -1 when ps 0 no longer answers. */
static int wait_next(const train_config *c, ps_client *pc, double began)
{
    for (;;) {
        double left = began + c->eval_secs - clk_mono_secs();
        json_t *st;
        if (ps_status(pc, 0, &st) != PS_OK)
            return -1;
        int64_t step = json_integer_value(json_object_get(st, "global_step"));
        json_decref(st);
        if (step >= c->train_steps)
            return 1;
        if (left <= 0 || train_stop_requested())
            return 0;
        train_sleep(left < 1 ? left : 1);
    }
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
    /* evaluator=1: ps 0 notes that an evaluator waits (evaluator_seen), so
     * the chief waits for its report of the last step at the end */
    train_wait_for_all(c, pc, "/readyz?evaluator=1", "the chief to initialize the variables");
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
        double began = clk_mono_secs();
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
            if (evaluate_and_report(c, pc, m, params, &ds, step) != 0)
                goto out;
            last = step;
        }
        if (step >= c->train_steps) {
            rc = 0;
            goto out;
        }
        int w = wait_next(c, pc, began);
        if (w < 0 && !train_stop_requested()) {
            printf("%s: the ps stopped; last evaluated global step %lld\n", c->name, (long long)last);
            rc = 0;
            goto out;
        }
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

