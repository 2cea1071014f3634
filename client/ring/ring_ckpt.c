/* ring_ckpt.c - the ring mode's training state as safetensors: the body the
 * chief broadcasts at start and the checkpoints it writes. See ring_ckpt.h. */
#include "ring/ring_ckpt.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckptdir.h"
#include "crc32c.h"
#include "safetensors.h"
#include "tensor.h"

static const char *const slot_names[OPTIM_KINDS][2] = {
    {NULL, NULL}, {"momentum", NULL}, {"adam_m", "adam_v"}, {"adagrad", NULL},
    {"rmsprop_ms", "rmsprop_mom"}};

/* "784,100,10": the input and each dense or conv layer's output size (the
 * older files' model check; "model" is the one that names it) */
static void layers_string(const model_layout *L, char *out, size_t cap)
{
    snprintf(out, cap, "%zu", L->n_in);
    for (int l = 0; l < L->n_layers; l++)
        if (L->layers[l].w >= 0) {
            size_t k = strlen(out);
            snprintf(out + k, cap - k, ",%zu", L->layers[l].out_numel);
        }
}

/* The tensors in body order and the data's pieces. */
typedef struct plan {
    st_desc d[3 * MODEL_MAX_TENSORS];
    char names[3 * MODEL_MAX_TENSORS][MODEL_NAME_MAX + 16];
    int n;
    st_part parts[3];
    int n_parts;
    char step_s[32], layers[512], workers_s[16], when[32], crc_s[16], shape_s[64];
    const char *meta[20];
    int n_meta;
} plan;

/* s's tensors and metadata, malloc'd: with saved_at for a checkpoint, without
 * for the body the chief sends. NULL with err when out of memory. */
static plan *plan_new(const ring_state *s, int saved_at, char *err, size_t errlen)
{
    plan *p = malloc(sizeof(*p));
    if (!p) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    const model_layout *L = s->layout;
    int ns = optim_slots(s->optimizer);
    float *bufs[3] = {s->params, s->slot0, s->slot1};
    p->n = 0;
    p->n_parts = 0;
    uint32_t crc = 0;
    for (int j = 0; j <= ns; j++) {
        for (int t = 0; t < L->n_tensors; t++) {
            if (j == 0)
                snprintf(p->names[p->n], sizeof(p->names[0]), "%s", L->tensors[t].name);
            else
                snprintf(p->names[p->n], sizeof(p->names[0]), "%s:%s", L->tensors[t].name,
                         slot_names[s->optimizer][j - 1]);
            p->d[p->n] = (st_desc){p->names[p->n], "F32", &L->tensors[t].shape};
            p->n++;
        }
        p->parts[p->n_parts++] = (st_part){bufs[j], L->n_params * 4};
        crc = crc32c_update(crc, bufs[j], L->n_params * 4);
    }
    snprintf(p->step_s, sizeof(p->step_s), "%lld", (long long)s->step);
    layers_string(L, p->layers, sizeof(p->layers));
    snprintf(p->workers_s, sizeof(p->workers_s), "%d", s->workers);
    snprintf(p->crc_s, sizeof(p->crc_s), "%08x", crc);
    model_shape_format(L->input, p->shape_s, sizeof(p->shape_s));
    const char *meta[] = {"format", RING_CKPT_FORMAT, "format_version", "1", "global_step", p->step_s,
                          "optimizer", optim_name(s->optimizer), "model", L->spec,
                          "input_shape", p->shape_s, "layers", p->layers, "workers", p->workers_s};
    memcpy(p->meta, meta, sizeof(meta));
    p->n_meta = (int)(sizeof(meta) / sizeof(meta[0]) / 2);
    if (saved_at) {
        time_t now = time(NULL);
        struct tm tmv;
        gmtime_r(&now, &tmv);
        strftime(p->when, sizeof(p->when), "%Y-%m-%dT%H:%M:%SZ", &tmv);
        p->meta[2 * p->n_meta] = "saved_at";
        p->meta[2 * p->n_meta++ + 1] = p->when;
    }
    p->meta[2 * p->n_meta] = "crc32c";
    p->meta[2 * p->n_meta++ + 1] = p->crc_s;
    return p;
}

int ring_state_encode(const ring_state *s, void **out, size_t *len, char *err, size_t errlen)
{
    plan *p = plan_new(s, 0, err, errlen);
    if (!p)
        return -1;
    char *head;
    size_t head_len;
    if (st_header_build(p->d, p->n, p->meta, p->n_meta, &head, &head_len, err, errlen) != 0) {
        free(p);
        return -1;
    }
    size_t total = head_len;
    for (int i = 0; i < p->n_parts; i++)
        total += p->parts[i].len;
    char *b = realloc(head, total);
    if (!b) {
        free(head);
        free(p);
        snprintf(err, errlen, "out of memory for a state of %zu bytes", total);
        return -1;
    }
    size_t at = head_len;
    for (int i = 0; i < p->n_parts; i++) {
        memcpy(b + at, p->parts[i].data, p->parts[i].len);
        at += p->parts[i].len;
    }
    free(p);
    *out = b;
    *len = total;
    return 0;
}

/* The header's metadata against s's model and optimizer: 0; CKPT_EINVALID
 * when it is not a ring state; CKPT_EOTHER when it is another model's or
 * optimizer's (err says which). */
static int check_meta(const st_file *f, const ring_state *s, char *err, size_t errlen)
{
    const model_layout *L = s->layout;
    const char *fmt = st_meta_get(f, "format"), *opt = st_meta_get(f, "optimizer"),
               *layers = st_meta_get(f, "layers"), *step_s = st_meta_get(f, "global_step"),
               *crc_s = st_meta_get(f, "crc32c");
    const char *model_s = st_meta_get(f, "model"), *shape_s = st_meta_get(f, "input_shape");
    char mine[512], my_shape[64];
    layers_string(L, mine, sizeof(mine));
    model_shape_format(L->input, my_shape, sizeof(my_shape));
    if (!fmt || strcmp(fmt, RING_CKPT_FORMAT) != 0 || !opt || !layers || !step_s || !crc_s) {
        snprintf(err, errlen, "not a %s body (format, optimizer, layers, global_step or crc32c missing)",
                 RING_CKPT_FORMAT);
        return CKPT_EINVALID;
    }
    /* files written before the model had a spec carry layers alone */
    if ((model_s && strcmp(model_s, L->spec) != 0) || (shape_s && strcmp(shape_s, my_shape) != 0)) {
        snprintf(err, errlen, "it holds the model %.200s on %.32s inputs; this job: %.200s on %s", model_s ? model_s : "?",
                 shape_s ? shape_s : "?", L->spec, my_shape);
        return CKPT_EOTHER;
    }
    if (strcmp(layers, mine) != 0 || strcmp(opt, optim_name(s->optimizer)) != 0) {
        snprintf(err, errlen, "it holds a %s model trained with %s; this job: %s with %s", layers, opt, mine,
                 optim_name(s->optimizer));
        return CKPT_EOTHER;
    }
    return 0;
}

/* The first NaN or Inf of s's buffers (params, then its optimizer's slots):
 * 1 with err naming the tensor and element, or 0 when every float is finite. */
static int find_nonfinite(const model_layout *L, optim_kind opt, const float *const bufs[3], char *err,
                          size_t errlen)
{
    int ns = optim_slots(opt);
    for (int j = 0; j <= ns; j++) {
        int64_t bad = tensor_find_nonfinite(bufs[j], L->n_params);
        if (bad < 0)
            continue;
        int t = 0;
        while (t + 1 < L->n_tensors && (size_t)bad >= L->tensors[t + 1].offset)
            t++;
        snprintf(err, errlen, "%s%s%s[%lld] is %s", L->tensors[t].name, j ? ":" : "",
                 j ? slot_names[opt][j - 1] : "", (long long)((size_t)bad - L->tensors[t].offset),
                 isnan(bufs[j][bad]) ? "NaN" : "Inf");
        return 1;
    }
    return 0;
}

int ring_state_decode(const void *buf, size_t len, ring_state *s, char *err, size_t errlen)
{
    st_file f;
    char e2[300];
    if (st_parse(buf, len, &f, e2, sizeof(e2)) != 0) {
        snprintf(err, errlen, "%s", e2);
        return CKPT_EINVALID;
    }
    const model_layout *L = s->layout;
    int rc, ns = optim_slots(s->optimizer);
    const char *step_s = st_meta_get(&f, "global_step"), *crc_s = st_meta_get(&f, "crc32c"),
               *workers_s = st_meta_get(&f, "workers");
    if ((rc = check_meta(&f, s, err, errlen)) != 0)
        goto out;
    rc = CKPT_EINVALID;
    const uint8_t *data = (const uint8_t *)buf + f.data_start;
    uint32_t crc = crc32c(data, f.data_len);
    char *end;
    unsigned long want = strtoul(crc_s, &end, 16);
    if (*end || (uint32_t)want != crc) {
        snprintf(err, errlen, "the data's CRC-32C is %08x, the header says %s", crc, crc_s);
        goto out;
    }
    errno = 0;
    long long step = strtoll(step_s, &end, 10);
    if (*end || errno || step < 0) {
        snprintf(err, errlen, "global_step '%s' is not a step", step_s);
        goto out;
    }
    if (f.n_tensors != (ns + 1) * L->n_tensors) {
        snprintf(err, errlen, "%d tensors, the model and its %s slots need %d", f.n_tensors,
                 optim_name(s->optimizer), (ns + 1) * L->n_tensors);
        goto out;
    }
    float *bufs[3] = {s->params, s->slot0, s->slot1};
    /* check every tensor before copying any: a body refused half-way must
     * leave s as it was (the caller falls back to an older one, or to none) */
    int at[3][MODEL_MAX_TENSORS];
    for (int j = 0; j <= ns; j++)
        for (int t = 0; t < L->n_tensors; t++) {
            char name[MODEL_NAME_MAX + 16];
            if (j == 0)
                snprintf(name, sizeof(name), "%s", L->tensors[t].name);
            else
                snprintf(name, sizeof(name), "%s:%s", L->tensors[t].name, slot_names[s->optimizer][j - 1]);
            int i = st_find(&f, name);
            if (i < 0 || strcmp(f.tensors[i].dtype, "F32") != 0 ||
                !tensor_shape_equal(&f.tensors[i].shape, &L->tensors[t].shape)) {
                snprintf(err, errlen, "tensor '%s' is missing or not F32 of the model's shape", name);
                goto out;
            }
            at[j][t] = i;
            /* a diverged state is no state to resume or train from */
            int64_t bad = tensor_find_nonfinite((const float *)(data + f.tensors[i].begin), L->tensors[t].numel);
            if (bad >= 0) {
                snprintf(err, errlen, "tensor '%s' holds a non-finite value at element %lld", name, (long long)bad);
                goto out;
            }
        }
    for (int j = 0; j <= ns; j++)
        for (int t = 0; t < L->n_tensors; t++)
            memcpy(bufs[j] + L->tensors[t].offset, data + f.tensors[at[j][t]].begin, L->tensors[t].numel * 4);
    s->step = step;
    s->workers = workers_s ? atoi(workers_s) : 0;
    rc = 0;
out:
    st_file_free(&f);
    return rc;
}

int ring_ckpt_write(const char *dir, const ring_state *s, int keep, char *path, size_t cap,
                    char *err, size_t errlen)
{
    if (ckptdir_make(dir, err, errlen) != 0)
        return -1;
    if (ckptdir_path(dir, s->step, path, cap) != 0) {
        snprintf(err, errlen, "'%s': path too long", dir);
        return -1;
    }
    /* never a checkpoint of a diverged state: it would push the last finite
     * one out (pruning keeps the newest `keep`) */
    const float *const bufs[3] = {s->params, s->slot0, s->slot1};
    char why[200];
    if (find_nonfinite(s->layout, s->optimizer, bufs, why, sizeof(why))) {
        snprintf(err, errlen, "not writing '%s': %s at global step %lld (the older checkpoints are kept)", path, why,
                 (long long)s->step);
        return -1;
    }
    plan *p = plan_new(s, 1, err, errlen);
    if (!p)
        return -1;
    int rc = st_write_file_parts(path, p->d, p->n, p->meta, p->n_meta, p->parts, p->n_parts, NULL, NULL,
                                 err, errlen);
    free(p);
    if (rc != 0)
        return -1;
    /* the newest `keep` up to this one; newer ones are not this run's
     * (broken ones restore passed over) and must not push this one out */
    ckptdir_prune(dir, keep, s->step);
    return 0;
}

/* The largest header a ring checkpoint can have: its tensors (3 per
 * variable at most) and metadata (the model's spec) take a few KiB. */
#define RING_CKPT_HEADER_MAX ((uint64_t)1 << 20)

/* Read the checkpoint at path for s, bounded by what s's model needs: a
 * regular file (opened without blocking: a FIFO is passed over), its prefix
 * and header (at most RING_CKPT_HEADER_MAX) read and checked first, then the
 * metadata (another model or optimizer: CKPT_EOTHER) and the data's size,
 * exactly the model's and its slots' floats; only then the rest. 0 with *out
 * (malloc'd, the whole file) and *len; CKPT_EINVALID, CKPT_EREAD or
 * CKPT_EOTHER with err. */
static int read_checkpoint(const char *path, const ring_state *s, void **out, size_t *len, char *err,
                           size_t errlen)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        snprintf(err, errlen, "%s", strerror(errno));
        return CKPT_EREAD;
    }
    int rc = CKPT_EINVALID;
    unsigned char *b = NULL;
    st_file f = {0};
    int parsed = 0;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(err, errlen, "%s", strerror(errno));
        rc = CKPT_EREAD;
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "not a regular file");
        goto out;
    }
    uint64_t size = (uint64_t)st.st_size, hl = 0;
    unsigned char prefix[8] = {0};
    char why[300];
    if (size >= 8 && st_pread_all(fd, prefix, 8, 0, NULL, 0) != 0) {
        snprintf(err, errlen, "%s", strerror(errno));
        rc = CKPT_EREAD;
        goto out;
    }
    if (st_read_prefix(prefix, size, &hl, why, sizeof(why)) != 0) {
        snprintf(err, errlen, "%s (file is %llu bytes)", why, (unsigned long long)size);
        goto out;
    }
    if (hl > RING_CKPT_HEADER_MAX) {
        snprintf(err, errlen, "a header of %llu bytes (a ring checkpoint's is under %llu; file is %llu bytes)",
                 (unsigned long long)hl, (unsigned long long)RING_CKPT_HEADER_MAX, (unsigned long long)size);
        goto out;
    }
    if (!(b = malloc((size_t)hl))) {
        snprintf(err, errlen, "out of memory for a header of %llu bytes", (unsigned long long)hl);
        rc = CKPT_EREAD;
        goto out;
    }
    if (st_pread_all(fd, b, (size_t)hl, 8, NULL, 0) != 0) {
        snprintf(err, errlen, "%s", strerror(errno));
        rc = CKPT_EREAD;
        goto out;
    }
    int pr = st_parse_header(b, hl, size - 8 - hl, &f, why, sizeof(why));
    if (pr != 0) {
        snprintf(err, errlen, "%s (file is %llu bytes)", why, (unsigned long long)size);
        rc = pr == ST_ENOMEM ? CKPT_EREAD : CKPT_EINVALID;
        goto out;
    }
    parsed = 1;
    if ((rc = check_meta(&f, s, err, errlen)) != 0)
        goto out;
    rc = CKPT_EINVALID;
    uint64_t want = (uint64_t)(optim_slots(s->optimizer) + 1) * s->layout->n_params * 4;
    if (f.data_len != want) {
        snprintf(err, errlen, "%llu data bytes; the model and its %s slots take %llu", (unsigned long long)f.data_len,
                 optim_name(s->optimizer), (unsigned long long)want);
        goto out;
    }
    free(b);
    if (!(b = malloc((size_t)size))) {
        snprintf(err, errlen, "out of memory for %llu bytes", (unsigned long long)size);
        rc = CKPT_EREAD;
        goto out;
    }
    if (st_pread_all(fd, b, (size_t)size, 0, NULL, 0) != 0) {
        snprintf(err, errlen, "%s", strerror(errno));
        rc = CKPT_EREAD;
        goto out;
    }
    *out = b;
    *len = (size_t)size;
    b = NULL;
    rc = 0;
out:
    if (parsed)
        st_file_free(&f);
    free(b);
    close(fd);
    return rc;
}

int ring_ckpt_restore(const char *dir, ring_state *s, char *path, size_t cap, char *err,
                      size_t errlen)
{
    ckptdir_entry *e;
    int n;
    if (ckptdir_list(dir, &e, &n, err, errlen) != 0)
        return -1;
    int rc = 0;
    for (int i = 0; i < n; i++) {
        snprintf(path, cap, "%s", e[i].path);
        void *b = NULL;
        size_t len = 0;
        char e2[400];
        int d = read_checkpoint(path, s, &b, &len, e2, sizeof(e2));
        if (d == 0) {
            d = ring_state_decode(b, len, s, e2, sizeof(e2));
            free(b);
        }
        if (d == 0) {
            rc = 1;
            break;
        }
        if (d == CKPT_EOTHER) {
            snprintf(err, errlen, "checkpoint '%s': %s: start with the same flags, or another --logdir",
                     path, e2);
            rc = -1;
            break;
        }
        fprintf(stderr, "workerd: skipping checkpoint '%s': %s\n", path, e2);
    }
    ckptdir_list_free(e, n);
    return rc;
}
