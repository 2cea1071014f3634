/* checkpoint.c - the checkpoint file format (see checkpoint.h). */
#include "checkpoint.h"
#include "jsonmem.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "safetensors.h"

static const char *const slot_names[OPTIM_KINDS][2] = {
    {NULL, NULL}, {"momentum", NULL}, {"adam_m", "adam_v"}, {"adagrad", NULL},
    {"rmsprop_ms", "rmsprop_mom"}};

/* CRC-32C over the metadata except meta_crc32c: keys in byte order, each
 * entry as key NUL value NUL. */
static int meta_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static uint32_t meta_crc(const char *const *kv, int n)
{
    const char **keys = malloc(sizeof(char *) * (size_t)(n ? n : 1));
    uint32_t c = 0;
    if (!keys)
        return 0;
    int m = 0;
    for (int i = 0; i < n; i++)
        if (strcmp(kv[2 * i], "meta_crc32c") != 0)
            keys[m++] = kv[2 * i];
    qsort(keys, (size_t)m, sizeof(char *), meta_cmp);
    for (int i = 0; i < m; i++) {
        const char *v = NULL;
        for (int j = 0; j < n; j++)
            if (kv[2 * j] == keys[i])
                v = kv[2 * j + 1];
        c = crc32c_update(c, keys[i], strlen(keys[i]) + 1);
        c = crc32c_update(c, v, strlen(v) + 1);
    }
    free(keys);
    return c;
}

static json_t *config_to_json(const store_saved *sv)
{
    if (!sv->configured)
        return json_null();
    const store_config *c = &sv->config;
    json_t *o = json_pack("{s:s,s:f,s:f,s:f,s:f,s:f,s:b,s:i,s:i,s:i,s:i}", "optimizer",
                     optim_name(c->optim.kind), "learning_rate", (double)c->optim.learning_rate,
                     "momentum", (double)c->optim.momentum, "beta1", (double)c->optim.beta1,
                     "beta2", (double)c->optim.beta2, "epsilon", (double)c->optim.epsilon, "sync",
                     c->sync, "replicas_to_aggregate", c->replicas_to_aggregate, "workers",
                     c->workers, "max_staleness", c->max_staleness, "staleness", c->staleness);
    const optim_config *p = &c->optim;
    if (o && json_object_update_new(
                 o, json_pack("{s:b,s:f,s:f,s:f,s:f,s:s,s:i,s:f,s:b,s:f}", "nesterov", p->nesterov,
                              "initial_accumulator_value", (double)p->initial_accumulator_value,
                              "rmsprop_decay", (double)p->rmsprop_decay, "clip_norm",
                              (double)p->clip_norm, "weight_decay", (double)p->weight_decay,
                              "lr_schedule", optim_schedule_name(p->lr_schedule), "decay_steps",
                              p->decay_steps, "decay_rate", (double)p->decay_rate, "staircase",
                              p->staircase, "alpha", (double)p->alpha)) != 0) {
        json_decref(o);
        o = NULL;
    }
    if (o && c->moving_average_decay > 0)
        json_object_set_new(o, "moving_average_decay", json_real(c->moving_average_decay));
    return o;
}

/* A variable's moving average is the tensor "<name>:" EMA_SLOT: ':' is not
 * in a variable's name, so it cannot be one (TF names it
 * "<name>/ExponentialMovingAverage"). */
#define EMA_SLOT "ExponentialMovingAverage"

static char *dump(json_t *j)
{
    char *s = j ? json_dumps_checked(j, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_ENCODE_ANY) : NULL;
    json_decref(j);
    return s;
}

/* The sparse variables' tensors, from d[*k] on: "NAME:ids" (I64 [n]),
 * "NAME:values" (F32 [n, dim]) and the slots "NAME:<slot>" (F32 [n, dim]),
 * rows least recently updated first; *s_sparse the metadata 'sparse' (JSON:
 * name -> declaration, version, updates, evicted, slots). 0, -1 (err), -2
 * out of memory. */
static int write_sparse(const store_saved *sv, st_desc *d, st_part *parts, char **names, tensor_shape *shapes,
                        int *k, json_t *crcs, char **s_sparse, char *err, size_t errlen)
{
    json_t *all = json_object();
    if (!all)
        return -2;
    for (int i = 0; i < sv->n_sparse; i++) {
        const store_saved_sparse *t = &sv->sparse[i];
        tensor_shape *ids_shape = &shapes[2 * i], *val_shape = &shapes[2 * i + 1];
        *ids_shape = (tensor_shape){.ndim = 1, .dims = {t->n}};
        *val_shape = (tensor_shape){.ndim = 2, .dims = {t->n, t->decl.dim}};
        size_t vb = (size_t)t->n * (size_t)t->decl.dim * 4;
        json_t *slots = json_array();
        for (int j = -2; j < t->n_slots; j++) {
            const char *sn = j == -2 ? "ids" : j == -1 ? "values"
                           : sv->configured ? slot_names[sv->config.optim.kind][j] : NULL;
            if (!sn) {
                json_decref(slots);
                json_decref(all);
                snprintf(err, errlen, "sparse variable '%s' has optimizer state its optimizer does not use", t->name);
                return -1;
            }
            if (asprintf(&names[*k], "%s:%s", t->name, sn) < 0) {
                names[*k] = NULL;
                json_decref(slots);
                json_decref(all);
                return -2;
            }
            const void *p = j == -2 ? (const void *)t->ids : j == -1 ? (const void *)t->values
                                                                   : (const void *)(t->slots + (size_t)j * (vb / 4));
            size_t nb = j == -2 ? (size_t)t->n * 8 : vb;
            d[*k] = (st_desc){names[*k], j == -2 ? "I64" : "F32", j == -2 ? ids_shape : val_shape};
            parts[*k] = (st_part){p, nb};
            char hex[9];
            snprintf(hex, sizeof(hex), "%08x", crc32c(p, nb));
            json_object_set_new(crcs, names[*k], json_string(hex));
            if (j >= 0)
                json_array_append_new(slots, json_string(sn));
            (*k)++;
        }
        json_object_set_new(all, t->name,
                            json_pack("{s:I,s:i,s:I,s:s,s:f,s:I,s:i,s:i,s:I,s:I,s:I,s:I,s:o}", "rows",
                                      (json_int_t)t->decl.rows, "dim", t->decl.dim, "max_rows",
                                      (json_int_t)t->decl.max_rows, "init",
                                      t->decl.init == SPARSE_INIT_UNIFORM ? "uniform" : "zeros", "init_scale",
                                      (double)t->decl.init_scale, "seed", (json_int_t)t->decl.seed, "shard",
                                      t->decl.shard, "shards", t->decl.shards, "held", (json_int_t)t->n, "version",
                                      (json_int_t)t->version, "updates", (json_int_t)t->updates, "evicted",
                                      (json_int_t)t->evicted, "slots", slots));
    }
    return (*s_sparse = dump(all)) ? 0 : -2;
}

int ckpt_write(const char *path, const store_saved *sv, const ckpt_info *info,
               void (*after_part)(void *ctx, int i), void *ctx, char *err, size_t errlen)
{
    int nt = 0;
    for (int i = 0; i < sv->n; i++)
        nt += 1 + sv->vars[i].n_slots + (sv->vars[i].shadow != NULL);
    for (int i = 0; i < sv->n_sparse; i++)
        nt += 2 + sv->sparse[i].n_slots;
    tensor_shape *shapes = calloc((size_t)(2 * sv->n_sparse + 1), sizeof(tensor_shape));
    char *s_sparse = NULL;
    st_desc *d = calloc((size_t)(nt ? nt : 1), sizeof(st_desc));
    st_part *parts = calloc((size_t)(nt ? nt : 1), sizeof(st_part));
    char **names = calloc((size_t)(nt ? nt : 1), sizeof(char *));
    json_t *vars = json_object(), *crcs = json_object(), *placed = json_array();
    char *s_config = NULL, *s_vars = NULL, *s_place = NULL, *s_state = NULL, *s_crc = NULL;
    int rc = -1;
    if (!d || !parts || !names || !vars || !crcs || !placed || !shapes)
        goto oom;
    int k = 0;
    for (int i = 0; i < sv->n; i++) {
        const store_saved_var *v = &sv->vars[i];
        size_t nb = (size_t)v->numel * 4;
        json_t *slots = json_array();
        if (!slots)
            goto oom;
        d[k] = (st_desc){v->name, "F32", &v->shape};
        parts[k] = (st_part){v->data->data, nb};
        char hex[9];
        snprintf(hex, sizeof(hex), "%08x", crc32c(v->data->data, nb));
        json_object_set_new(crcs, v->name, json_string(hex));
        k++;
        for (int j = 0; j < v->n_slots; j++) {
            const char *sn = sv->configured ? slot_names[sv->config.optim.kind][j] : NULL;
            if (!sn) {
                json_decref(slots);
                snprintf(err, errlen, "variable '%s' has optimizer state its optimizer does not use",
                         v->name);
                goto out;
            }
            if (asprintf(&names[k], "%s:%s", v->name, sn) < 0) {
                names[k] = NULL;
                json_decref(slots);
                goto oom;
            }
            const float *p = v->slots + (size_t)j * (size_t)v->numel;
            d[k] = (st_desc){names[k], "F32", &v->shape};
            parts[k] = (st_part){p, nb};
            snprintf(hex, sizeof(hex), "%08x", crc32c(p, nb));
            json_object_set_new(crcs, names[k], json_string(hex));
            json_array_append_new(slots, json_string(sn));
            k++;
        }
        if (v->shadow) {
            if (asprintf(&names[k], "%s:%s", v->name, EMA_SLOT) < 0) {
                names[k] = NULL;
                json_decref(slots);
                goto oom;
            }
            d[k] = (st_desc){names[k], "F32", &v->shape};
            parts[k] = (st_part){v->shadow, nb};
            snprintf(hex, sizeof(hex), "%08x", crc32c(v->shadow, nb));
            json_object_set_new(crcs, names[k], json_string(hex));
            k++;
        }
        json_t *shape = json_array();
        for (int d2 = 0; d2 < v->shape.ndim; d2++)
            json_array_append_new(shape, json_integer(v->shape.dims[d2]));
        json_t *vinfo = json_pack("{s:I,s:I,s:o,s:o}", "version", (json_int_t)v->version,
                                  "updates", (json_int_t)v->updates, "slots", slots, "shape", shape);
        if (vinfo && v->shadow)
            json_object_set_new(vinfo, "moving_average", json_true());
        json_object_set_new(vars, v->name, vinfo);
        json_array_append_new(placed, json_string(v->name));
    }
    if (sv->n_sparse > 0) {
        int sr = write_sparse(sv, d, parts, names, shapes, &k, crcs, &s_sparse, err, errlen);
        if (sr == -2)
            goto oom;
        if (sr != 0)
            goto out;
    }
    s_config = dump(config_to_json(sv));
    s_vars = dump(vars);
    vars = NULL;
    json_t *map = sv->placement ? json_loads(sv->placement, 0, NULL) : NULL;
    /* the model the chief's placement names (h_placement_put checked both:
     * short printable strings), so a reader rebuilds it from this file */
    char model_s[512] = "", shape_s[64] = "";
    const char *ms = json_string_value(json_object_get(map, "model")),
               *ss = json_string_value(json_object_get(map, "input_shape"));
    if (ms && ss && strlen(ms) < sizeof(model_s) && strlen(ss) < sizeof(shape_s)) {
        snprintf(model_s, sizeof(model_s), "%s", ms);
        snprintf(shape_s, sizeof(shape_s), "%s", ss);
    }
    s_place = dump(json_pack("{s:i,s:i,s:o,s:o}", "ps_task", info->task_index, "ps_tasks",
                             info->ps_tasks, "variables", placed, "map", map ? map : json_null()));
    placed = NULL;
    s_state = dump(json_pack("{s:o,s:I,s:I}", "last_loss",
                             sv->has_loss ? json_real(sv->last_loss) : json_null(),
                             "stale_dropped", (json_int_t)sv->stale_dropped, "pushes_applied",
                             (json_int_t)sv->pushes_applied));
    s_crc = dump(crcs);
    crcs = NULL;
    if (!s_config || !s_vars || !s_place || !s_state || !s_crc)
        goto oom;
    char step[32], task[32], nps[16], when[32], mcrc[9];
    snprintf(step, sizeof(step), "%lld", (long long)sv->global_step);
    snprintf(task, sizeof(task), "ps:%d", info->task_index);
    snprintf(nps, sizeof(nps), "%d", info->ps_tasks);
    time_t now = time(NULL);
    struct tm tmv;
    gmtime_r(&now, &tmv);
    strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tmv);
    const char *meta[] = {"format", CKPT_FORMAT, "format_version", CKPT_FORMAT_VERSION,
                          "global_step", step, "task", task, "ps_tasks", nps, "saved_at", when,
                          "config", s_config, "variables", s_vars, "placement", s_place,
                          "state", s_state, "crc32c", s_crc, "meta_crc32c", mcrc,
                          "model", model_s, "input_shape", shape_s, "sparse", s_sparse};
    int n_meta = (int)(sizeof(meta) / sizeof(meta[0]) / 2) - 1 - (model_s[0] ? 0 : 2);
    if (s_sparse) { /* after model and input_shape, or in their place */
        meta[2 * n_meta] = "sparse";
        meta[2 * n_meta + 1] = s_sparse;
        n_meta++;
    }
    snprintf(mcrc, sizeof(mcrc), "%08x", meta_crc(meta, n_meta));
    rc = st_write_file_parts(path, d, nt, meta, n_meta, parts, nt, after_part, ctx, err, errlen);
    goto out;
oom:
    snprintf(err, errlen, "out of memory writing %s", path);
out:
    json_decref(vars);
    json_decref(crcs);
    json_decref(placed);
    free(s_config);
    free(s_vars);
    free(s_place);
    free(s_state);
    free(s_crc);
    free(s_sparse);
    free(shapes);
    if (names)
        for (int i = 0; i < nt; i++)
            free(names[i]);
    free(names);
    free(parts);
    free(d);
    return rc;
}

/* Read tensor ti of f (in the file fd) into dst and check it against its
 * CRC-32C in crcs. 0, CKPT_EREAD (err) when it could not be read, or
 * CKPT_EINVALID (err) when its checksum does not match. */
static int read_tensor(int fd, const st_file *f, const st_tensor *ti, json_t *crcs, void *dst,
                       char *err, size_t errlen)
{
    size_t nb = (size_t)(ti->end - ti->begin);
    char why[256];
    if (st_pread_all(fd, dst, nb, f->data_start + ti->begin, why, sizeof(why)) != 0) {
        snprintf(err, errlen, "tensor '%s': %s", ti->name, why);
        return CKPT_EREAD;
    }
    const char *want = json_string_value(json_object_get(crcs, ti->name));
    char hex[9];
    snprintf(hex, sizeof(hex), "%08x", crc32c(dst, nb));
    if (!want || strcmp(want, hex) != 0) {
        snprintf(err, errlen, "tensor '%s': checksum does not match (file says %s, data gives %s)",
                 ti->name, want ? want : "nothing", hex);
        return CKPT_EINVALID;
    }
    return 0;
}

static json_t *meta_json(const st_file *f, const char *key, char *err, size_t errlen)
{
    const char *s = st_meta_get(f, key);
    if (!s) {
        snprintf(err, errlen, "metadata '%s' is missing", key);
        return NULL;
    }
    json_error_t je;
    json_t *j = json_loads(s, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &je);
    if (!j)
        snprintf(err, errlen, "metadata '%s' is not JSON: %s", key, je.text);
    return j;
}

static int parse_config(json_t *j, store_saved *out, char *err, size_t errlen)
{
    if (json_is_null(j)) {
        out->configured = 0;
        return 0;
    }
    const char *opt = json_string_value(json_object_get(j, "optimizer"));
    optim_kind kind;
    json_t *sync = json_object_get(j, "sync"), *r = json_object_get(j, "replicas_to_aggregate"),
           *w = json_object_get(j, "workers");
    if (!opt || optim_from_name(opt, &kind) != 0 || !json_is_boolean(sync) ||
        !json_is_integer(r) || !json_is_integer(w) || json_integer_value(w) < 1 ||
        json_integer_value(w) > STORE_MAX_WORKERS || json_integer_value(r) < 1 ||
        json_integer_value(r) > json_integer_value(w)) {
        snprintf(err, errlen, "metadata 'config' is not a training configuration");
        return -1;
    }
    store_config *c = &out->config;
    memset(c, 0, sizeof(*c));
    c->optim.kind = kind;
    c->optim.learning_rate = (float)json_number_value(json_object_get(j, "learning_rate"));
    c->optim.momentum = (float)json_number_value(json_object_get(j, "momentum"));
    c->optim.beta1 = (float)json_number_value(json_object_get(j, "beta1"));
    c->optim.beta2 = (float)json_number_value(json_object_get(j, "beta2"));
    c->optim.epsilon = (float)json_number_value(json_object_get(j, "epsilon"));
    /* absent in checkpoints from before these settings: off */
    c->optim.nesterov = json_is_true(json_object_get(j, "nesterov"));
    c->optim.initial_accumulator_value =
        (float)json_number_value(json_object_get(j, "initial_accumulator_value"));
    c->optim.rmsprop_decay = (float)json_number_value(json_object_get(j, "rmsprop_decay"));
    c->optim.clip_norm = (float)json_number_value(json_object_get(j, "clip_norm"));
    c->optim.weight_decay = (float)json_number_value(json_object_get(j, "weight_decay"));
    json_t *sch = json_object_get(j, "lr_schedule"), *ds = json_object_get(j, "decay_steps");
    if (sch && (!json_is_string(sch) ||
                optim_schedule_from_name(json_string_value(sch), &c->optim.lr_schedule) != 0)) {
        snprintf(err, errlen, "metadata 'config' has an unknown lr_schedule");
        return -1;
    }
    c->optim.decay_steps = json_is_integer(ds) && json_integer_value(ds) > 0 &&
                                   json_integer_value(ds) <= INT32_MAX
                               ? (int)json_integer_value(ds)
                               : 0;
    c->optim.decay_rate = (float)json_number_value(json_object_get(j, "decay_rate"));
    c->optim.staircase = json_is_true(json_object_get(j, "staircase"));
    c->optim.alpha = (float)json_number_value(json_object_get(j, "alpha"));
    optim_clear_unused(&c->optim);
    if (c->optim.lr_schedule != OPTIM_LR_CONSTANT && c->optim.decay_steps < 1) {
        snprintf(err, errlen, "metadata 'config' has a schedule without decay_steps");
        return -1;
    }
    c->sync = json_is_true(sync);
    c->replicas_to_aggregate = (int)json_integer_value(r);
    c->workers = (int)json_integer_value(w);
    json_t *ms = json_object_get(j, "max_staleness"), *sb = json_object_get(j, "staleness");
    c->max_staleness = json_is_integer(ms) ? (int)json_integer_value(ms) : -1;
    c->staleness = json_is_integer(sb) ? (int)json_integer_value(sb) : -1;
    json_t *ma = json_object_get(j, "moving_average_decay");
    if (ma && !(json_is_number(ma) && optim_ema_decay_ok(json_number_value(ma)))) {
        snprintf(err, errlen, "metadata 'config' has a moving_average_decay outside (0, 1)");
        return -1;
    }
    c->moving_average_decay = ma ? (float)json_number_value(ma) : 0.0f;
    if (!(c->optim.learning_rate > 0)) {
        snprintf(err, errlen, "metadata 'config' has no positive learning_rate");
        return -1;
    }
    out->configured = 1;
    return 0;
}

static int var_cmp(const void *a, const void *b)
{
    return strcmp(((const store_saved_var *)a)->name, ((const store_saved_var *)b)->name);
}

/* What ckpt_read holds while it reads one file: the file, its parsed
 * header, the metadata's JSON objects, and where the variables go. */
typedef struct ckpt_reader {
    int fd;
    uint64_t len; /* the file's size */
    bufpool *pool;
    st_file f;
    json_t *config, *vars, *crcs, *state, *place;
    store_saved *out;
    int used; /* tensors read: the variables, their slots and moving averages */
    char *err;
    size_t errlen;
} ckpt_reader;

/* What kind of entry st is, for a log line: "a fifo", "a folder", ... */
static const char *kind_of(mode_t m)
{
    return S_ISDIR(m) ? "a folder" : S_ISFIFO(m) ? "a fifo" : S_ISSOCK(m) ? "a socket"
         : S_ISCHR(m) ? "a character device" : S_ISBLK(m) ? "a block device"
         : S_ISLNK(m) ? "a symbolic link" : "not a file";
}

/* Open path, a regular file, into rd (fd, len). 0, or CKPT_EREAD (err).
 * Never blocks on what is not a regular file (a FIFO's open waits for a
 * writer): it is looked at first and opened O_NONBLOCK, then checked again
 * on the descriptor (it may have been replaced in between). */
static int reader_open(ckpt_reader *rd, const char *path, int follow)
{
    struct stat pst;
    if ((follow ? stat(path, &pst) : lstat(path, &pst)) != 0) {
        snprintf(rd->err, rd->errlen, "%s", strerror(errno));
        return CKPT_EREAD;
    }
    if (!S_ISREG(pst.st_mode)) {
        snprintf(rd->err, rd->errlen, "not a regular file (%s)", kind_of(pst.st_mode));
        return CKPT_EREAD;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | (follow ? 0 : O_NOFOLLOW));
    if (fd < 0) {
        snprintf(rd->err, rd->errlen, "%s", strerror(errno));
        return CKPT_EREAD;
    }
    struct stat fst;
    if (fstat(fd, &fst) != 0 || !S_ISREG(fst.st_mode)) {
        snprintf(rd->err, rd->errlen, "not a regular file");
        close(fd);
        return CKPT_EREAD;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    rd->fd = fd;
    rd->len = (uint64_t)fst.st_size;
    return 0;
}

/* The safetensors header, read whole and parsed into rd->f. 0, CKPT_EREAD
 * or CKPT_EINVALID (err). */
static int read_header(ckpt_reader *rd)
{
    char why[256];
    uint64_t len = rd->len, hl = 0;
    unsigned char prefix[8] = {0};
    if (len >= 8 && st_pread_all(rd->fd, prefix, 8, 0, why, sizeof(why)) != 0) {
        snprintf(rd->err, rd->errlen, "%s", why);
        return CKPT_EREAD;
    }
    if (st_read_prefix(prefix, len, &hl, why, sizeof(why)) != 0) {
        snprintf(rd->err, rd->errlen, "%s (file is %llu bytes)", why, (unsigned long long)len);
        return CKPT_EINVALID;
    }
    unsigned char *head = malloc((size_t)hl);
    if (!head) {
        snprintf(rd->err, rd->errlen, "out of memory for a header of %llu bytes", (unsigned long long)hl);
        return CKPT_EREAD;
    }
    if (st_pread_all(rd->fd, head, (size_t)hl, 8, why, sizeof(why)) != 0) {
        snprintf(rd->err, rd->errlen, "%s", why);
        free(head);
        return CKPT_EREAD;
    }
    int pr = st_parse_header(head, hl, len - 8 - hl, &rd->f, why, sizeof(why));
    free(head);
    if (pr != 0) {
        snprintf(rd->err, rd->errlen, "%s (file is %llu bytes)", why, (unsigned long long)len);
        return pr == ST_ENOMEM ? CKPT_EREAD : CKPT_EINVALID;
    }
    return 0;
}

/* The metadata's format, format_version and checksum (meta_crc32c). 0, or
 * CKPT_EINVALID (err). */
static int check_format(ckpt_reader *rd)
{
    const st_file *f = &rd->f;
    char *err = rd->err;
    size_t errlen = rd->errlen;
    const char *fmt = st_meta_get(f, "format"), *ver = st_meta_get(f, "format_version");
    if (!fmt || strcmp(fmt, CKPT_FORMAT) != 0 || !ver) {
        snprintf(err, errlen, "not a restps checkpoint (metadata 'format' is %s%s%s)",
                 fmt ? "'" : "", fmt ? fmt : "missing", fmt ? "'" : "");
        return CKPT_EINVALID;
    }
    if (strcmp(ver, CKPT_FORMAT_VERSION) != 0) {
        snprintf(err, errlen, "format_version '%s' is not one this psd reads (%s)", ver,
                 CKPT_FORMAT_VERSION);
        return CKPT_EINVALID;
    }
    const char **kv = malloc(sizeof(char *) * 2 * (size_t)(f->n_meta ? f->n_meta : 1));
    if (!kv) {
        snprintf(err, errlen, "out of memory");
        return CKPT_EINVALID;
    }
    for (int i = 0; i < f->n_meta; i++) {
        kv[2 * i] = f->meta[i].key;
        kv[2 * i + 1] = f->meta[i].value;
    }
    uint32_t mc = meta_crc(kv, f->n_meta);
    free(kv);
    const char *mcs = st_meta_get(f, "meta_crc32c");
    char mhex[9];
    snprintf(mhex, sizeof(mhex), "%08x", mc);
    if (!mcs || strcmp(mcs, mhex) != 0) {
        snprintf(err, errlen, "metadata checksum does not match (file says %s, metadata gives %s)",
                 mcs ? mcs : "nothing", mhex);
        return CKPT_EINVALID;
    }
    return 0;
}

/* The global step into out, and (self not NULL) that the file is this
 * task's. 0, CKPT_EINVALID or CKPT_EOTHER (err). */
static int check_owner(ckpt_reader *rd, const ckpt_info *self)
{
    const st_file *f = &rd->f;
    char *err = rd->err;
    size_t errlen = rd->errlen;
    const char *step_s = st_meta_get(f, "global_step");
    char *end = NULL;
    long long step = step_s ? strtoll(step_s, &end, 10) : -1;
    if (!step_s || *end || step < 0) {
        snprintf(err, errlen, "metadata 'global_step' is not a step");
        return CKPT_EINVALID;
    }
    rd->out->global_step = step;
    if (self) {
        const char *task = st_meta_get(f, "task"), *nps = st_meta_get(f, "ps_tasks");
        char want[32];
        snprintf(want, sizeof(want), "ps:%d", self->task_index);
        if (!task || !nps || strcmp(task, want) != 0 || atoi(nps) != self->ps_tasks) {
            snprintf(err, errlen, "it is %s of a cluster of %s ps tasks; this is %s of %d",
                     task ? task : "?", nps ? nps : "?", want, self->ps_tasks);
            return CKPT_EOTHER;
        }
    }
    return 0;
}

/* The metadata's config (into out), variables, crc32c and state, and that
 * every tensor has a checksum and is F32. 0, or CKPT_EINVALID (err). */
static int read_meta_objects(ckpt_reader *rd)
{
    char *err = rd->err;
    size_t errlen = rd->errlen;
    if (!(rd->config = meta_json(&rd->f, "config", err, errlen)) ||
        parse_config(rd->config, rd->out, err, errlen) ||
        !(rd->vars = meta_json(&rd->f, "variables", err, errlen)) ||
        !(rd->crcs = meta_json(&rd->f, "crc32c", err, errlen)) ||
        !(rd->state = meta_json(&rd->f, "state", err, errlen)))
        return CKPT_EINVALID;
    if (!json_is_object(rd->vars) || !json_is_object(rd->crcs) || !json_is_object(rd->state)) {
        snprintf(err, errlen, "metadata 'variables', 'crc32c' and 'state' must be JSON objects");
        return CKPT_EINVALID;
    }
    /* every tensor has a checksum (each is checked as it is read below) */
    for (int t = 0; t < rd->f.n_tensors; t++) {
        const st_tensor *ti = &rd->f.tensors[t];
        if (!json_is_string(json_object_get(rd->crcs, ti->name))) {
            snprintf(err, errlen, "tensor '%s': checksum does not match (file says nothing)",
                     ti->name);
            return CKPT_EINVALID;
        }
        const char *colon = strrchr(ti->name, ':');
        int sparse_ids = colon && strcmp(colon, ":ids") == 0 && strcmp(ti->dtype, "I64") == 0;
        if (strcmp(ti->dtype, "F32") != 0 && !sparse_ids) {
            snprintf(err, errlen, "tensor '%s' has dtype %s, checkpoints hold F32", ti->name,
                     ti->dtype);
            return CKPT_EINVALID;
        }
    }
    return 0;
}

/* Variable v's optimizer slots (the metadata's list, slots) read from the
 * file. 0, CKPT_EREAD or CKPT_EINVALID (err). */
static int read_slots(ckpt_reader *rd, store_saved_var *v, const char *name, json_t *slots)
{
    store_saved *out = rd->out;
    const st_file *f = &rd->f;
    char *err = rd->err;
    size_t errlen = rd->errlen;
    size_t nb = (size_t)v->numel * 4;
    int ns = (int)json_array_size(slots);
    int need = out->configured ? optim_slots(out->config.optim.kind) : 0;
    if (ns != 0 && ns != need) {
        snprintf(err, errlen, "variable '%s' has %d optimizer slots, %s needs %d", name, ns,
                 out->configured ? optim_name(out->config.optim.kind) : "no optimizer", need);
        return CKPT_EINVALID;
    }
    if (ns > 0 && !(v->slots = malloc((size_t)ns * nb))) {
        snprintf(err, errlen, "out of memory");
        return CKPT_EREAD;
    }
    v->n_slots = ns;
    for (int j = 0; j < ns; j++) {
        const char *want = slot_names[out->config.optim.kind][j];
        const char *sn = json_string_value(json_array_get(slots, (size_t)j));
        char tn[TENSOR_NAME_MAX + 32];
        snprintf(tn, sizeof(tn), "%s:%s", name, want);
        int st = sn && strcmp(sn, want) == 0 ? st_find(f, tn) : -1;
        if (st < 0 || !tensor_shape_equal(&f->tensors[st].shape, &v->shape)) {
            snprintf(err, errlen, "variable '%s': optimizer slot '%s' is missing or has another shape",
                     name, want);
            return CKPT_EINVALID;
        }
        int rc = read_tensor(rd->fd, f, &f->tensors[st], rd->crcs, v->slots + (size_t)j * (size_t)v->numel,
                             err, errlen);
        if (rc != 0)
            return rc;
        rd->used++;
    }
    return 0;
}

/* Variable v's moving average when the metadata says it has one (has_ma:
 * true, false or absent). 0, CKPT_EREAD or CKPT_EINVALID (err). */
static int read_moving_average(ckpt_reader *rd, store_saved_var *v, const char *name, json_t *has_ma)
{
    const st_file *f = &rd->f;
    char *err = rd->err;
    size_t errlen = rd->errlen;
    if (json_is_true(has_ma)) {
        char tn[TENSOR_NAME_MAX + 32];
        snprintf(tn, sizeof(tn), "%s:%s", name, EMA_SLOT);
        int st = st_find(f, tn);
        if (st < 0 || !tensor_shape_equal(&f->tensors[st].shape, &v->shape)) {
            snprintf(err, errlen, "variable '%s': its moving average is missing or has another shape",
                     name);
            return CKPT_EINVALID;
        }
        if (!(v->shadow = malloc((size_t)v->numel * 4))) {
            snprintf(err, errlen, "out of memory");
            return CKPT_EREAD;
        }
        int rc = read_tensor(rd->fd, f, &f->tensors[st], rd->crcs, v->shadow, err, errlen);
        if (rc != 0)
            return rc;
        rd->used++;
    } else if (has_ma && !json_is_false(has_ma)) {
        snprintf(err, errlen, "variable '%s': moving_average must be true or false", name);
        return CKPT_EINVALID;
    }
    return 0;
}

/* The variable name (info: its metadata) into the next of out->vars: its
 * tensor, slots and moving average. 0, CKPT_EREAD or CKPT_EINVALID (err). */
static int read_variable(ckpt_reader *rd, const char *name, json_t *info)
{
    store_saved *out = rd->out;
    const st_file *f = &rd->f;
    char *err = rd->err;
    size_t errlen = rd->errlen;
    store_saved_var *v = &out->vars[out->n];
    int t = st_find(f, name);
    json_t *ver_j = json_object_get(info, "version"), *upd = json_object_get(info, "updates"),
           *slots = json_object_get(info, "slots");
    char nerr[128];
    if (t < 0 || tensor_name_check(name, nerr, sizeof(nerr)) != 0 || !json_is_integer(ver_j) ||
        !json_is_integer(upd) || !json_is_array(slots)) {
        snprintf(err, errlen, "variable '%.64s': %s", name,
                 t < 0 ? "no tensor holds it" : "its metadata is not {version, updates, slots}");
        return CKPT_EINVALID;
    }
    const st_tensor *ti = &f->tensors[t];
    /* the header's shape is outside the checksums: it must be the one
     * the metadata (under meta_crc32c) recorded */
    json_t *shp = json_object_get(info, "shape");
    int same = json_is_array(shp) && (int)json_array_size(shp) == ti->shape.ndim;
    for (int d2 = 0; same && d2 < ti->shape.ndim; d2++)
        same = json_is_integer(json_array_get(shp, (size_t)d2)) &&
               json_integer_value(json_array_get(shp, (size_t)d2)) == ti->shape.dims[d2];
    if (!same) {
        snprintf(err, errlen, "variable '%.64s': its shape in the header is not the one in the metadata",
                 name);
        return CKPT_EINVALID;
    }
    snprintf(v->name, sizeof(v->name), "%s", name);
    v->shape = ti->shape;
    v->numel = tensor_shape_numel(&ti->shape);
    v->version = (uint64_t)json_integer_value(ver_j);
    v->updates = json_integer_value(upd);
    size_t nb = (size_t)v->numel * 4;
    if (!(v->data = blob_new(rd->pool, nb))) {
        snprintf(err, errlen, "out of memory");
        return CKPT_EREAD;
    }
    out->n++;
    int rc = read_tensor(rd->fd, f, ti, rd->crcs, v->data->data, err, errlen);
    if (rc != 0)
        return rc;
    rd->used++;
    if ((rc = read_slots(rd, v, name, slots)) != 0)
        return rc;
    return read_moving_average(rd, v, name, json_object_get(info, "moving_average"));
}

/* Tensor NAME:suffix with dtype and shape [n] or [n, dim] into dst
 * (bytes). 0, CKPT_EREAD or CKPT_EINVALID (err). */
static int read_sparse_tensor(ckpt_reader *rd, const char *name, const char *suffix, const char *dtype, int64_t n,
                              int dim, void *dst)
{
    char tn[TENSOR_NAME_MAX + 32];
    snprintf(tn, sizeof(tn), "%s:%s", name, suffix);
    int t = st_find(&rd->f, tn);
    const st_tensor *ti = t >= 0 ? &rd->f.tensors[t] : NULL;
    if (!ti || strcmp(ti->dtype, dtype) != 0 || ti->shape.ndim != (dim ? 2 : 1) || ti->shape.dims[0] != n ||
        (dim && ti->shape.dims[1] != dim)) {
        snprintf(rd->err, rd->errlen, "sparse variable '%.64s': tensor '%s' is missing or not %s of %lld rows", name,
                 tn, dtype, (long long)n);
        return CKPT_EINVALID;
    }
    rd->used++;
    return read_tensor(rd->fd, &rd->f, ti, rd->crcs, dst, rd->err, rd->errlen);
}

static int64_t sp_int(json_t *o, const char *key, int64_t lo, int64_t hi, int *bad)
{
    json_t *v = json_object_get(o, key);
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        *bad = 1;
        return 0;
    }
    return json_integer_value(v);
}

/* One sparse variable (info: its metadata) into the next of out->sparse. */
static int read_sparse_one(ckpt_reader *rd, const char *name, json_t *info)
{
    store_saved *out = rd->out;
    store_saved_sparse *t = &out->sparse[out->n_sparse];
    int bad = 0;
    char nerr[128];
    sparse_decl d = {.rows = sp_int(info, "rows", 0, SPARSE_ROWS_MAX, &bad),
                     .dim = (int)sp_int(info, "dim", 1, SPARSE_DIM_MAX, &bad),
                     .max_rows = sp_int(info, "max_rows", 1, SPARSE_ROWS_MAX, &bad),
                     .seed = (uint64_t)sp_int(info, "seed", 0, INT64_MAX, &bad),
                     .shard = (int)sp_int(info, "shard", 0, 4095, &bad),
                     .shards = (int)sp_int(info, "shards", 1, 4096, &bad)};
    const char *init = json_string_value(json_object_get(info, "init"));
    json_t *scale = json_object_get(info, "init_scale"), *slots = json_object_get(info, "slots");
    d.init = init && strcmp(init, "uniform") == 0 ? SPARSE_INIT_UNIFORM : SPARSE_INIT_ZEROS;
    d.init_scale = (float)json_number_value(scale);
    int64_t held = sp_int(info, "held", 0, d.max_rows, &bad);
    if (bad || !init || !json_is_number(scale) || !json_is_array(slots) || tensor_name_check(name, nerr, sizeof(nerr)) ||
        sparse_decl_check(&d, nerr, sizeof(nerr)) != 0) {
        snprintf(rd->err, rd->errlen, "sparse variable '%.64s': its metadata is not a declaration", name);
        return CKPT_EINVALID;
    }
    int ns = (int)json_array_size(slots), need = out->configured ? optim_slots(out->config.optim.kind) : 0;
    if (ns != 0 && ns != need) {
        snprintf(rd->err, rd->errlen, "sparse variable '%.64s' has %d optimizer slots, the optimizer needs %d", name,
                 ns, need);
        return CKPT_EINVALID;
    }
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->decl = d;
    t->n = held;
    t->n_slots = ns;
    t->version = (uint64_t)sp_int(info, "version", 0, INT64_MAX, &bad);
    t->updates = sp_int(info, "updates", 0, INT64_MAX, &bad);
    t->evicted = sp_int(info, "evicted", 0, INT64_MAX, &bad);
    out->n_sparse++;
    size_t rows = (size_t)(held ? held : 1), vb = rows * (size_t)d.dim * 4;
    t->ids = malloc(rows * 8);
    t->values = malloc(vb);
    t->slots = ns ? malloc(vb * (size_t)ns) : NULL;
    if (!t->ids || !t->values || (ns && !t->slots)) {
        snprintf(rd->err, rd->errlen, "out of memory");
        return CKPT_EREAD;
    }
    int rc = bad ? CKPT_EINVALID : read_sparse_tensor(rd, name, "ids", "I64", held, 0, t->ids);
    if (bad)
        snprintf(rd->err, rd->errlen, "sparse variable '%.64s': its metadata is not a declaration", name);
    if (rc == 0)
        rc = read_sparse_tensor(rd, name, "values", "F32", held, d.dim, t->values);
    for (int j = 0; rc == 0 && j < ns; j++) {
        const char *want = slot_names[out->config.optim.kind][j];
        const char *sn = json_string_value(json_array_get(slots, (size_t)j));
        if (!sn || strcmp(sn, want) != 0) {
            snprintf(rd->err, rd->errlen, "sparse variable '%.64s': slot %d is not '%s'", name, j, want);
            return CKPT_EINVALID;
        }
        rc = read_sparse_tensor(rd, name, want, "F32", held, d.dim, t->slots + (size_t)j * (vb / 4));
    }
    for (int64_t i = 0; rc == 0 && i < held; i++) {
        int64_t id = t->ids[i];
        if (id < 0 || (d.rows > 0 && id >= d.rows) || id % d.shards != d.shard) {
            snprintf(rd->err, rd->errlen, "sparse variable '%.64s': id %lld is not one of its ids", name, (long long)id);
            rc = CKPT_EINVALID;
        }
    }
    return rc;
}

/* The metadata's 'sparse' (absent: none) into out->sparse. */
static int read_sparse(ckpt_reader *rd)
{
    if (!st_meta_get(&rd->f, "sparse"))
        return 0;
    json_t *all = meta_json(&rd->f, "sparse", rd->err, rd->errlen);
    if (!json_is_object(all)) {
        if (all)
            snprintf(rd->err, rd->errlen, "metadata 'sparse' must be a JSON object");
        json_decref(all);
        return CKPT_EINVALID;
    }
    size_t n = json_object_size(all);
    if (!(rd->out->sparse = calloc(n ? n : 1, sizeof(store_saved_sparse)))) {
        json_decref(all);
        snprintf(rd->err, rd->errlen, "out of memory");
        return CKPT_EREAD;
    }
    const char *name;
    json_t *info;
    int rc = 0;
    json_object_foreach(all, name, info) {
        if ((rc = read_sparse_one(rd, name, info)) != 0)
            break;
    }
    json_decref(all);
    return rc;
}

/* Every variable of the metadata into out->vars (sorted by name), and no
 * tensor left over. 0, CKPT_EREAD or CKPT_EINVALID (err). */
static int read_variables(ckpt_reader *rd)
{
    store_saved *out = rd->out;
    size_t nv = json_object_size(rd->vars);
    out->vars = calloc(nv ? nv : 1, sizeof(store_saved_var));
    if (!out->vars) {
        snprintf(rd->err, rd->errlen, "out of memory");
        return CKPT_EINVALID;
    }
    const char *name;
    json_t *info;
    json_object_foreach(rd->vars, name, info) {
        int rc = read_variable(rd, name, info);
        if (rc != 0)
            return rc;
    }
    int rc = read_sparse(rd);
    if (rc != 0)
        return rc;
    if (rd->used != rd->f.n_tensors) {
        snprintf(rd->err, rd->errlen, "%d tensors are neither a variable nor a slot of one",
                 rd->f.n_tensors - rd->used);
        return CKPT_EINVALID;
    }
    qsort(out->vars, (size_t)out->n, sizeof(store_saved_var), var_cmp);
    return 0;
}

/* The placement map (when there is one) and the metadata's state into out.
 * 0, or CKPT_EINVALID (err). */
static int read_state(ckpt_reader *rd)
{
    store_saved *out = rd->out;
    /* the chief's placement map, when it sent one (older files may lack it) */
    rd->place = meta_json(&rd->f, "placement", rd->err, rd->errlen);
    json_t *map = rd->place ? json_object_get(rd->place, "map") : NULL;
    if (json_is_object(map) && !(out->placement = json_dumps_checked(map, JSON_COMPACT | JSON_PRESERVE_ORDER))) {
        snprintf(rd->err, rd->errlen, "out of memory");
        return CKPT_EINVALID;
    }
    json_t *ll = json_object_get(rd->state, "last_loss");
    out->has_loss = json_is_number(ll);
    out->last_loss = out->has_loss ? json_number_value(ll) : 0;
    out->stale_dropped = json_integer_value(json_object_get(rd->state, "stale_dropped"));
    out->pushes_applied = json_integer_value(json_object_get(rd->state, "pushes_applied"));
    return 0;
}

int ckpt_read(const char *path, bufpool *pool, const ckpt_info *self, store_saved *out, char *err,
              size_t errlen)
{
    memset(out, 0, sizeof(*out));
    ckpt_reader rd = {.fd = -1, .pool = pool, .out = out, .err = err, .errlen = errlen};
    memset(&rd.f, 0, sizeof(rd.f));
    /* only the header is read whole; each tensor goes straight from the file
     * into its blob, checked as it lands (peak memory: the model, once) */
    int rc = reader_open(&rd, path, 1);
    if (rc != 0)
        return rc;
    if ((rc = read_header(&rd)) == 0 && (rc = check_format(&rd)) == 0 && (rc = check_owner(&rd, self)) == 0 &&
        (rc = read_meta_objects(&rd)) == 0 && (rc = read_variables(&rd)) == 0)
        rc = read_state(&rd);
    if (rc != 0)
        store_saved_free(out);
    json_decref(rd.config);
    json_decref(rd.vars);
    json_decref(rd.crcs);
    json_decref(rd.state);
    json_decref(rd.place);
    st_file_free(&rd.f);
    close(rd.fd);
    return rc;
}

int ckpt_owned(const char *path, const ckpt_info *self, char *err, size_t errlen)
{
    store_saved out;
    memset(&out, 0, sizeof(out));
    ckpt_reader rd = {.fd = -1, .out = &out, .err = err, .errlen = errlen};
    memset(&rd.f, 0, sizeof(rd.f));
    int rc = reader_open(&rd, path, 0);
    if (rc != 0)
        return rc;
    if ((rc = read_header(&rd)) == 0 && (rc = check_format(&rd)) == 0)
        rc = check_owner(&rd, self);
    st_file_free(&rd.f);
    close(rd.fd);
    return rc;
}
