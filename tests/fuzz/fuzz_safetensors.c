/* fuzz_safetensors.c - the safetensors reader (common/safetensors.c): prefix,
 * header JSON, dtypes, shapes and data offsets. Whatever parses must describe
 * tensors that lie inside the data and tile it, and must survive a round trip
 * through st_header_build. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "safetensors.h"

static int by_begin(const void *a, const void *b)
{
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : (x->end > y->end) - (x->end < y->end);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_file f;
    char err[512] = "";
    if (st_parse(data, size, &f, err, sizeof(err)) != 0) {
        FUZZ_CHECK(err[0] != '\0'); /* every refusal says why */
        return 0;
    }
    FUZZ_CHECK(f.data_start + f.data_len == size);
    uint64_t sum = 0;
    unsigned x = 0;
    for (int i = 0; i < f.n_tensors; i++) {
        const st_tensor *t = &f.tensors[i];
        size_t es = st_dtype_size(t->dtype);
        FUZZ_CHECK(es != 0 && t->begin <= t->end && t->end <= f.data_len);
        FUZZ_CHECK(t->end - t->begin == (uint64_t)tensor_shape_numel(&t->shape) * es);
        FUZZ_CHECK(st_find(&f, t->name) == i);
        if (t->end > t->begin) /* the bytes are there: ASan would see an over-read */
            x += data[f.data_start + t->begin] + data[f.data_start + t->end - 1];
        sum += t->end - t->begin;
    }
    FUZZ_CHECK(sum == f.data_len);
    for (int i = 0; i < f.n_meta; i++)
        FUZZ_CHECK(st_meta_get(&f, f.meta[i].key) != NULL);
    (void)x;

    /* Round trip: the same tensors in data order, the same metadata. */
    st_tensor **order = malloc(sizeof(*order) * (size_t)(f.n_tensors + 1));
    st_desc *d = malloc(sizeof(*d) * (size_t)(f.n_tensors + 1));
    const char **kv = malloc(sizeof(*kv) * 2 * (size_t)(f.n_meta + 1));
    FUZZ_CHECK(order && d && kv);
    for (int i = 0; i < f.n_tensors; i++)
        order[i] = &f.tensors[i];
    qsort(order, (size_t)f.n_tensors, sizeof(*order), by_begin);
    for (int i = 0; i < f.n_tensors; i++)
        d[i] = (st_desc){order[i]->name, order[i]->dtype, &order[i]->shape};
    for (int i = 0; i < f.n_meta; i++) {
        kv[2 * i] = f.meta[i].key;
        kv[2 * i + 1] = f.meta[i].value;
    }
    char *hdr = NULL;
    size_t hlen = 0;
    FUZZ_CHECK(st_header_build(d, f.n_tensors, kv, f.n_meta, &hdr, &hlen, err, sizeof(err)) == 0);
    st_file g;
    int rc = st_parse_header(hdr + 8, hlen - 8, f.data_len, &g, err, sizeof(err));
    if (rc != 0)
        fprintf(stderr, "round trip refused: %s\n", err);
    FUZZ_CHECK(rc == 0);
    FUZZ_CHECK(g.n_tensors == f.n_tensors && g.n_meta == f.n_meta);
    for (int i = 0; i < f.n_tensors; i++) {
        int j = st_find(&g, f.tensors[i].name);
        FUZZ_CHECK(j >= 0 && g.tensors[j].begin == f.tensors[i].begin &&
                   g.tensors[j].end == f.tensors[i].end &&
                   strcmp(g.tensors[j].dtype, f.tensors[i].dtype) == 0 &&
                   tensor_shape_equal(&g.tensors[j].shape, &f.tensors[i].shape));
    }
    for (int i = 0; i < f.n_meta; i++) {
        const char *v = st_meta_get(&g, f.meta[i].key);
        FUZZ_CHECK(v && strcmp(v, f.meta[i].value) == 0);
    }
    st_file_free(&g);
    free(hdr);
    free(kv);
    free(d);
    free(order);
    st_file_free(&f);
    return 0;
}
