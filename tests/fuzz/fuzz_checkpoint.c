/* fuzz_checkpoint.c - the checkpoint loader (server/checkpoint.c ckpt_read):
 * the safetensors file, its metadata (format, checksums, global_step, task,
 * config, variables, crc32c, state, placement) and the optimizer slots.
 *
 * Input: one flags byte, then the file. Random bytes rarely carry matching
 * CRC-32Cs, so with flag 1 the harness first rewrites the file with correct
 * checksums (the tensors' crc32c, unless flag 4 keeps the file's, and
 * meta_crc32c), letting the fuzzer reach the checks behind them. Flag 2
 * checks the task (ps:0 of 1 ps tasks); else no task check. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "checkpoint.h"
#include "crc32c.h"
#include "fuzz_util.h"
#include "safetensors.h"

static bufpool *pool;

static int by_begin(const void *a, const void *b)
{
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : (x->end > y->end) - (x->end < y->end);
}

static int by_key(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The file with checksums that match (checkpoint.h's definition), or NULL
 * when it is not safetensors at all. */
static uint8_t *with_checksums(const uint8_t *in, size_t len, int keep_tensor_crcs, size_t *out_len)
{
    st_file f;
    char err[512];
    if (st_parse(in, len, &f, err, sizeof(err)) != 0)
        return NULL;
    int nt = f.n_tensors;
    st_tensor **order = malloc(sizeof(*order) * (size_t)(nt + 1));
    st_desc *d = malloc(sizeof(*d) * (size_t)(nt + 1));
    const char **kv = malloc(sizeof(*kv) * 2 * (size_t)(f.n_meta + 2));
    const char **keys = malloc(sizeof(*keys) * (size_t)(f.n_meta + 2));
    FUZZ_CHECK(order && d && kv && keys);
    for (int i = 0; i < nt; i++)
        order[i] = &f.tensors[i];
    qsort(order, (size_t)nt, sizeof(*order), by_begin);
    for (int i = 0; i < nt; i++)
        d[i] = (st_desc){order[i]->name, order[i]->dtype, &order[i]->shape};
    json_t *crcs = json_object();
    for (int i = 0; i < nt; i++) {
        char hex[9];
        snprintf(hex, sizeof(hex), "%08x",
                 crc32c(in + f.data_start + order[i]->begin, (size_t)(order[i]->end - order[i]->begin)));
        json_object_set_new(crcs, order[i]->name, json_string(hex));
    }
    char *crc_s = json_dumps(crcs, JSON_COMPACT);
    json_decref(crcs);
    FUZZ_CHECK(crc_s);
    int m = 0;
    for (int i = 0; i < f.n_meta; i++) {
        if (strcmp(f.meta[i].key, "meta_crc32c") == 0 ||
            (!keep_tensor_crcs && strcmp(f.meta[i].key, "crc32c") == 0))
            continue;
        kv[2 * m] = f.meta[i].key;
        kv[2 * m + 1] = f.meta[i].value;
        m++;
    }
    if (!keep_tensor_crcs || !st_meta_get(&f, "crc32c")) {
        kv[2 * m] = "crc32c";
        kv[2 * m + 1] = crc_s;
        m++;
    }
    for (int i = 0; i < m; i++)
        keys[i] = kv[2 * i];
    qsort(keys, (size_t)m, sizeof(*keys), by_key);
    uint32_t c = 0;
    for (int i = 0; i < m; i++) {
        const char *v = NULL;
        for (int j = 0; j < m; j++)
            if (kv[2 * j] == keys[i])
                v = kv[2 * j + 1];
        c = crc32c_update(c, keys[i], strlen(keys[i]) + 1);
        c = crc32c_update(c, v, strlen(v) + 1);
    }
    char mhex[9];
    snprintf(mhex, sizeof(mhex), "%08x", c);
    kv[2 * m] = "meta_crc32c";
    kv[2 * m + 1] = mhex;
    m++;
    char *hdr = NULL;
    size_t hlen = 0;
    uint8_t *out = NULL;
    if (st_header_build(d, nt, kv, m, &hdr, &hlen, err, sizeof(err)) == 0) {
        out = malloc(hlen + f.data_len + 1);
        FUZZ_CHECK(out);
        memcpy(out, hdr, hlen);
        if (f.data_len)
            memcpy(out + hlen, in + f.data_start, f.data_len);
        *out_len = hlen + f.data_len;
    }
    free(hdr);
    free(crc_s);
    free(keys);
    free(kv);
    free(d);
    free(order);
    st_file_free(&f);
    return out;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    if (!pool)
        pool = bufpool_new(0);
    FUZZ_CHECK(pool);
    unsigned flags = data[0];
    data++;
    size--;
    uint8_t *fixed = NULL;
    size_t fixed_len = 0;
    if (flags & 1)
        fixed = with_checksums(data, size, (flags & 4) != 0, &fixed_len);
    char path[64], err[512] = "";
    int fd = fixed ? fuzz_memfile(fixed, fixed_len, path, sizeof(path))
                   : fuzz_memfile(data, size, path, sizeof(path));
    free(fixed);
    if (fd < 0)
        return 0;
    ckpt_info self = {0, 1};
    store_saved sv;
    int rc = ckpt_read(path, pool, (flags & 2) ? &self : NULL, &sv, err, sizeof(err));
    if (getenv("FUZZ_VERBOSE")) /* to check what a corpus file reaches */
        fprintf(stderr, "ckpt_read: %d %s\n", rc, rc == 0 ? "ok" : err);
    if (rc == 0) {
        FUZZ_CHECK(sv.global_step >= 0);
        for (int i = 0; i < sv.n; i++) {
            const store_saved_var *v = &sv.vars[i];
            FUZZ_CHECK(v->numel == tensor_shape_numel(&v->shape) && v->data &&
                       v->data->cap >= (size_t)v->numel * 4);
            FUZZ_CHECK(tensor_name_check(v->name, err, sizeof(err)) == 0);
            if (i)
                FUZZ_CHECK(strcmp(sv.vars[i - 1].name, v->name) < 0);
        }
        store_saved_free(&sv);
    } else {
        FUZZ_CHECK(rc == CKPT_EINVALID || rc == CKPT_EREAD || rc == CKPT_EOTHER);
        FUZZ_CHECK(err[0] != '\0');
    }
    close(fd);
    return 0;
}
