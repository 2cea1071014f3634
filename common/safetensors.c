/* safetensors.c - parse, validate and build safetensors headers. */
#include "safetensors.h"
#include "jsonmem.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int st_pread_all(int fd, void *buf, size_t len, uint64_t off, char *err, size_t errlen)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, (unsigned char *)buf + got, len - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            int e = r < 0 ? errno : EIO;
            if (err)
                snprintf(err, errlen, "read failed at byte %llu: %s", (unsigned long long)(off + got),
                         r < 0 ? strerror(e) : "end of file");
            errno = e;
            return -1;
        }
        got += (size_t)r;
    }
    return 0;
}

static const struct {
    const char *name;
    size_t size;
} dtypes[] = {
    {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4},
    {"I16", 2}, {"I8", 1},  {"U64", 8}, {"U32", 4},  {"U16", 2}, {"U8", 1},
    {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
};

size_t st_dtype_size(const char *dtype)
{
    for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
        if (strcmp(dtypes[i].name, dtype) == 0)
            return dtypes[i].size;
    return 0;
}

int st_read_prefix(const void *buf8, uint64_t total_len, uint64_t *header_len, char *err,
                   size_t errlen)
{
    if (total_len < 8) {
        snprintf(err, errlen, "safetensors: body of %llu bytes is shorter than the 8-byte prefix",
                 (unsigned long long)total_len);
        return -1;
    }
    const uint8_t *b = buf8;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | b[i];
    if (n > ST_MAX_HEADER || n > total_len - 8) {
        snprintf(err, errlen, "safetensors: header length %llu runs past the body of %llu bytes",
                 (unsigned long long)n, (unsigned long long)total_len);
        return -1;
    }
    if (n < 2) {
        snprintf(err, errlen, "safetensors: header length %llu is too short",
                 (unsigned long long)n);
        return -1;
    }
    *header_len = n;
    return 0;
}

void st_file_free(st_file *f)
{
    if (!f)
        return;
    for (int i = 0; i < f->n_tensors; i++)
        free(f->tensors[i].name);
    for (int i = 0; i < f->n_meta; i++) {
        free(f->meta[i].key);
        free(f->meta[i].value);
    }
    free(f->tensors);
    free(f->meta);
    memset(f, 0, sizeof(*f));
}

static int cmp_begin(const void *a, const void *b)
{
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static int parse_u64(json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return -1;
    *out = (uint64_t)json_integer_value(v);
    return 0;
}

static int parse_tensor(const char *name, json_t *obj, uint64_t data_len, st_tensor *t,
                        char *err, size_t errlen)
{
    if (!json_is_object(obj)) {
        snprintf(err, errlen, "safetensors: entry '%s' is not an object", name);
        return -1;
    }
    json_t *dt = json_object_get(obj, "dtype"), *sh = json_object_get(obj, "shape"),
           *off = json_object_get(obj, "data_offsets");
    if (!json_is_string(dt) || !json_is_array(sh) || !json_is_array(off)) {
        snprintf(err, errlen, "safetensors: entry '%s' needs dtype, shape and data_offsets", name);
        return -1;
    }
    const char *dts = json_string_value(dt);
    size_t esize = st_dtype_size(dts);
    if (esize == 0) {
        snprintf(err, errlen, "safetensors: entry '%s' has unknown dtype '%.16s'", name, dts);
        return -1;
    }
    snprintf(t->dtype, sizeof(t->dtype), "%s", dts);
    size_t nd = json_array_size(sh);
    if (nd > TENSOR_MAX_DIMS) {
        snprintf(err, errlen, "safetensors: entry '%s' has more than %d dimensions", name,
                 TENSOR_MAX_DIMS);
        return -1;
    }
    uint64_t numel = 1;
    t->shape.ndim = (int)nd;
    for (size_t i = 0; i < nd; i++) {
        uint64_t d;
        if (parse_u64(json_array_get(sh, i), &d) != 0 || d > (uint64_t)TENSOR_MAX_ELEMS) {
            snprintf(err, errlen, "safetensors: entry '%s' has a bad dimension", name);
            return -1;
        }
        if (d && numel > (uint64_t)TENSOR_MAX_ELEMS / d) {
            snprintf(err, errlen, "safetensors: entry '%s' element count overflows", name);
            return -1;
        }
        numel *= d;
        t->shape.dims[i] = (int64_t)d;
    }
    if (json_array_size(off) != 2 || parse_u64(json_array_get(off, 0), &t->begin) != 0 ||
        parse_u64(json_array_get(off, 1), &t->end) != 0) {
        snprintf(err, errlen, "safetensors: entry '%s' data_offsets must be [begin, end]", name);
        return -1;
    }
    if (t->begin > t->end || t->end > data_len) {
        snprintf(err, errlen,
                 "safetensors: entry '%s' offsets [%llu, %llu] out of range of %llu data bytes",
                 name, (unsigned long long)t->begin, (unsigned long long)t->end,
                 (unsigned long long)data_len);
        return -1;
    }
    if (t->end - t->begin != numel * esize) {
        snprintf(err, errlen, "safetensors: entry '%s' has %llu bytes, its shape needs %llu", name,
                 (unsigned long long)(t->end - t->begin), (unsigned long long)(numel * esize));
        return -1;
    }
    return 0;
}

int st_parse_header(const void *header, uint64_t header_len, uint64_t data_len,
                    st_file *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    const char *h = header;
    if (header_len == 0 || h[0] != '{') {
        snprintf(err, errlen, "safetensors: header is not a JSON object");
        return -1;
    }
    json_error_t jerr;
    int oom = 0;
    unsigned long failed = json_failed_allocs();
    json_t *root = json_loadb(h, header_len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        /* jansson may call a failed allocation a syntax error (jsonmem.h) */
        if (json_failed_allocs() != failed || json_error_code(&jerr) == json_error_out_of_memory) {
            snprintf(err, errlen, "safetensors: out of memory parsing the header");
            return ST_ENOMEM;
        }
        snprintf(err, errlen, "safetensors: header JSON: %s at position %d", jerr.text,
                 jerr.position);
        return -1;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        snprintf(err, errlen, "safetensors: header is not a JSON object");
        return -1;
    }
    size_t n = json_object_size(root);
    out->tensors = calloc(n ? n : 1, sizeof(st_tensor));
    st_tensor **order = calloc(n ? n : 1, sizeof(st_tensor *));
    if (!out->tensors || !order) {
        snprintf(err, errlen, "safetensors: out of memory");
        oom = 1;
        goto fail;
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val)
    {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(val)) {
                snprintf(err, errlen, "safetensors: __metadata__ is not an object");
                goto fail;
            }
            size_t m = json_object_size(val);
            out->meta = calloc(m ? m : 1, sizeof(st_meta));
            if (!out->meta) {
                snprintf(err, errlen, "safetensors: out of memory");
                oom = 1;
                goto fail;
            }
            const char *mk;
            json_t *mv;
            json_object_foreach(val, mk, mv)
            {
                if (!json_is_string(mv)) {
                    snprintf(err, errlen, "safetensors: __metadata__ value of '%.64s' is not a string",
                             mk);
                    goto fail;
                }
                out->meta[out->n_meta].key = strdup(mk);
                out->meta[out->n_meta].value = strdup(json_string_value(mv));
                out->n_meta++;
                if (!out->meta[out->n_meta - 1].key || !out->meta[out->n_meta - 1].value) {
                    snprintf(err, errlen, "safetensors: out of memory");
                    oom = 1;
                    goto fail;
                }
            }
            continue;
        }
        if (key[0] == '\0') { /* st_header_build refuses it too */
            snprintf(err, errlen, "safetensors: a tensor has an empty name");
            goto fail;
        }
        st_tensor *t = &out->tensors[out->n_tensors];
        t->name = strdup(key);
        out->n_tensors++;
        if (!t->name) {
            snprintf(err, errlen, "safetensors: out of memory");
            oom = 1;
            goto fail;
        }
        if (parse_tensor(key, val, data_len, t, err, errlen) != 0)
            goto fail;
        order[out->n_tensors - 1] = t;
    }
    /* The tensors must tile the data section exactly. */
    qsort(order, (size_t)out->n_tensors, sizeof(order[0]), cmp_begin);
    uint64_t at = 0;
    for (int i = 0; i < out->n_tensors; i++) {
        if (order[i]->begin != at) {
            snprintf(err, errlen, "safetensors: entry '%s' at offset %llu %s", order[i]->name,
                     (unsigned long long)order[i]->begin,
                     order[i]->begin < at ? "overlaps the previous tensor"
                                          : "leaves a hole after the previous tensor");
            goto fail;
        }
        at = order[i]->end;
    }
    if (at != data_len) {
        snprintf(err, errlen, "safetensors: tensors cover %llu of %llu data bytes",
                 (unsigned long long)at, (unsigned long long)data_len);
        goto fail;
    }
    out->header_len = header_len;
    out->data_start = 8 + header_len;
    out->data_len = data_len;
    free(order);
    json_decref(root);
    return 0;
fail:
    free(order);
    json_decref(root);
    st_file_free(out);
    return oom ? ST_ENOMEM : -1;
}

int st_parse(const void *buf, uint64_t len, st_file *out, char *err, size_t errlen)
{
    uint64_t hl;
    memset(out, 0, sizeof(*out));
    if (st_read_prefix(buf, len, &hl, err, errlen) != 0)
        return -1;
    return st_parse_header((const char *)buf + 8, hl, len - 8 - hl, out, err, errlen);
}

const char *st_meta_get(const st_file *f, const char *key)
{
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[i].key, key) == 0)
            return f->meta[i].value;
    return NULL;
}

int st_find(const st_file *f, const char *name)
{
    for (int i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0)
            return i;
    return -1;
}

int st_header_build(const st_desc *t, int n, const char *const *meta_kv, int n_meta,
                    char **out, size_t *out_len, char *err, size_t errlen)
{
    json_t *root = json_object();
    if (!root)
        goto oom;
    if (n_meta > 0) {
        json_t *m = json_object();
        if (!m || json_object_set_new(root, "__metadata__", m) != 0)
            goto oom;
        for (int i = 0; i < n_meta; i++)
            if (json_object_set_new(m, meta_kv[2 * i], json_string(meta_kv[2 * i + 1])) != 0)
                goto oom;
    }
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        const char *dt = t[i].dtype ? t[i].dtype : "F32";
        if (!t[i].name || !*t[i].name || strcmp(t[i].name, "__metadata__") == 0 ||
            json_object_get(root, t[i].name)) {
            snprintf(err, errlen, "safetensors: tensor name '%s' is empty, reserved or repeated",
                     t[i].name ? t[i].name : "");
            json_decref(root);
            return -1;
        }
        size_t es = st_dtype_size(dt);
        if (es == 0) {
            snprintf(err, errlen, "safetensors: unknown dtype '%s'", dt);
            json_decref(root);
            return -1;
        }
        uint64_t nb = (uint64_t)tensor_shape_numel(t[i].shape) * es;
        json_t *shape = json_array();
        if (!shape)
            goto oom;
        for (int d = 0; d < t[i].shape->ndim; d++)
            if (json_array_append_new(shape, json_integer(t[i].shape->dims[d])) != 0) {
                json_decref(shape);
                goto oom;
            }
        json_t *e = json_pack("{s:s,s:o,s:[I,I]}", "dtype", dt, "shape", shape, "data_offsets",
                              (json_int_t)at, (json_int_t)(at + nb));
        if (!e || json_object_set_new(root, t[i].name, e) != 0) {
            snprintf(err, errlen, "safetensors: cannot add entry '%s'", t[i].name);
            json_decref(root);
            return -1;
        }
        at += nb;
    }
    char *js = json_dumps_checked(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!js)
        goto oom_nofree;
    size_t jl = strlen(js);
    size_t hl = (jl + 7) & ~(size_t)7; /* pad so data starts 8-byte aligned */
    char *buf = malloc(8 + hl);
    if (!buf) {
        free(js);
        goto oom_nofree;
    }
    for (int i = 0; i < 8; i++)
        buf[i] = (char)(((uint64_t)hl >> (8 * i)) & 0xff);
    memcpy(buf + 8, js, jl);
    memset(buf + 8 + jl, ' ', hl - jl);
    free(js);
    *out = buf;
    *out_len = 8 + hl;
    return 0;
oom:
    json_decref(root);
oom_nofree:
    snprintf(err, errlen, "safetensors: out of memory building header");
    return -1;
}

static int write_all(int fd, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    while (len) {
        ssize_t w = write(fd, p, len);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

int st_write_file(const char *path, const st_desc *t, int n, const char *const *meta_kv,
                  int n_meta, const void *data, size_t data_len, char *err, size_t errlen)
{
    st_part part = {data, data_len};
    return st_write_file_parts(path, t, n, meta_kv, n_meta, &part, 1, NULL, NULL, err, errlen);
}

int st_write_file_parts(const char *path, const st_desc *t, int n, const char *const *meta_kv,
                        int n_meta, const st_part *parts, int n_parts,
                        void (*after_part)(void *ctx, int i), void *ctx, char *err, size_t errlen)
{
    char *head;
    size_t head_len;
    uint64_t want = 0, have = 0;
    for (int i = 0; i < n; i++)
        want += (uint64_t)tensor_shape_numel(t[i].shape) * st_dtype_size(t[i].dtype ? t[i].dtype : "F32");
    for (int i = 0; i < n_parts; i++)
        have += parts[i].len;
    if (want != have) {
        snprintf(err, errlen, "safetensors: %s: the tensors take %llu bytes, the data holds %llu",
                 path, (unsigned long long)want, (unsigned long long)have);
        return -1;
    }
    if (st_header_build(t, n, meta_kv, n_meta, &head, &head_len, err, errlen) != 0)
        return -1;
    size_t pl = strlen(path);
    char *tmp = malloc(pl + 32);
    if (!tmp) {
        free(head);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    snprintf(tmp, pl + 32, "%s" ST_TEMP_INFIX "%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int rc = -1;
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    int bad = write_all(fd, head, head_len) != 0;
    for (int i = 0; !bad && i < n_parts; i++) {
        bad = write_all(fd, parts[i].data, parts[i].len) != 0;
        if (!bad && after_part)
            after_part(ctx, i);
    }
    if (bad || fsync(fd) != 0) {
        snprintf(err, errlen, "%s: %s", tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        goto out;
    }
    if (close(fd) != 0 || rename(tmp, path) != 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        unlink(tmp);
        goto out;
    }
    /* the rename itself must survive a crash: fsync the folder */
    char *dir = strdup(path);
    if (dir) {
        char *slash = strrchr(dir, '/');
        if (slash == dir)
            dir[1] = '\0';
        else if (slash)
            *slash = '\0';
        else
            strcpy(dir, ".");
        int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0) {
            fsync(dfd);
            close(dfd);
        }
        free(dir);
    }
    rc = 0;
out:
    free(tmp);
    free(head);
    return rc;
}
