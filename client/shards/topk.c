/* topk.c - top-k sparsification with error feedback (topk.h). */
#include "shards/topk.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int topk_init(topk *t, double ratio, size_t n)
{
    *t = (topk){.ratio = ratio, .n = n};
    t->resid = calloc(n ? n : 1, sizeof(float));
    t->next = calloc(n ? n : 1, sizeof(float));
    if (!t->resid || !t->next) {
        topk_free(t);
        return -1;
    }
    return 0;
}

void topk_free(topk *t)
{
    free(t->resid);
    free(t->next);
    free(t->mag);
    *t = (topk){0};
}

int64_t topk_count(const topk *t, int64_t numel, size_t vsize, size_t esize)
{
    if (t->ratio <= 0 || numel <= 1 || numel > INT32_MAX)
        return 0;
    int64_t k = (int64_t)ceil(t->ratio * (double)numel);
    if (k < 1)
        k = 1;
    return (uint64_t)k * (4 + vsize) < (uint64_t)numel * esize ? k : 0;
}

/* a[0..n): the element that sorts at position want, there (ascending), the
 * smaller ones before it, the larger after (Hoare's selection). */
static void select_nth(float *a, int64_t n, int64_t want)
{
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        float x = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < x)
                i++;
            while (a[j] > x)
                j--;
            if (i <= j) {
                float s = a[i];
                a[i++] = a[j];
                a[j--] = s;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return;
    }
}

int topk_pick(topk *t, const float *grad, size_t off, int64_t numel, int64_t k, int32_t *ids, float *vals)
{
    float *next = t->next + off;
    const float *res = t->resid + off;
    if ((size_t)numel > t->mag_cap) {
        float *m = realloc(t->mag, sizeof(float) * (size_t)numel);
        if (!m)
            return -1;
        t->mag = m;
        t->mag_cap = (size_t)numel;
    }
    for (int64_t i = 0; i < numel; i++) {
        next[i] = res[i] + grad[i];
        t->mag[i] = fabsf(next[i]);
    }
    select_nth(t->mag, numel, numel - k);
    float thr = t->mag[numel - k];
    int64_t above = 0;
    for (int64_t i = numel - k + 1; i < numel; i++)
        above += t->mag[i] > thr;
    /* the elements at the threshold, lowest ids first, fill what is left */
    int64_t ties = k - above, n = 0;
    for (int64_t i = 0; i < numel && n < k; i++) {
        float m = fabsf(next[i]);
        if (m > thr || (m == thr && ties > 0)) {
            ties -= m == thr;
            ids[n] = (int32_t)i;
            vals[n++] = next[i];
            next[i] = 0;
        }
    }
    return 0;
}

void topk_sent_whole(topk *t, size_t off, int64_t numel)
{
    memset(t->next + off, 0, sizeof(float) * (size_t)numel);
}

void topk_keep_rounding(topk *t, size_t off, int32_t id, float picked, float sent)
{
    t->next[off + (size_t)id] = picked - sent;
}

void topk_commit(topk *t)
{
    float *s = t->resid;
    t->resid = t->next;
    t->next = s;
}
