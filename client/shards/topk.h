/* topk.h - top-k sparsification with error feedback (workerd --topk_ratio;
 * Deep Gradient Compression's, without its momentum correction): a push
 * carries each gradient's k largest elements by magnitude, as ids and
 * values; what it leaves is kept, and added to the next step's gradient
 * before the next pick, so every element's gradient arrives, only late.
 *
 * The residual is committed only when the push was taken: a push that
 * failed leaves it as it was (the step's gradient is dropped, as a dense
 * push's is). */
#ifndef RESTPS_TOPK_H
#define RESTPS_TOPK_H

#include <stddef.h>
#include <stdint.h>

typedef struct topk {
    double ratio;
    size_t n;      /* floats in the whole gradient buffer */
    float *resid;  /* what earlier pushes left */
    float *next;   /* resid + this push's gradient, less what it carries */
    float *mag;    /* scratch: magnitudes for the selection */
    size_t mag_cap;
} topk;

/* ratio in (0, 1), n floats; 0, or -1 out of memory. */
int topk_init(topk *t, double ratio, size_t n);
void topk_free(topk *t);

/* How many of numel elements a push carries (ceil(ratio * numel), at least
 * 1), or 0 when the pair (4-byte ids, vsize-byte values) would not be
 * smaller than the dense tensor in esize-byte elements (then it goes whole)
 * or numel does not fit 4-byte ids. */
int64_t topk_count(const topk *t, int64_t numel, size_t vsize, size_t esize);

/* The pick of the tensor at offset off of the buffer, its gradient grad
 * (numel floats): next = resid + grad there; the k largest |next| (ties: the lower id) into ids
 * (ascending) and vals, and zeroed in next. 0, or -1 out of memory. */
int topk_pick(topk *t, const float *grad, size_t off, int64_t numel, int64_t k, int32_t *ids, float *vals);
/* A tensor of this push sent whole (or picked): next = its resid + grad
 * less what went (whole: nothing is left). */
void topk_sent_whole(topk *t, size_t off, int64_t numel);
/* The value that went out for one element (a 16-bit cast of vals[i]): the
 * rest of the rounding is kept. */
void topk_keep_rounding(topk *t, size_t off, int32_t id, float picked, float sent);
/* The push was taken: next becomes the residual. */
void topk_commit(topk *t);

#endif
